"""Meta-device construction and deterministic, layout-independent weight init.

Each parameter is drawn in float32 from its own CPU generator seeded by (seed, canonical name),
then cast and copied, so its value depends only on (seed, name, shape): not on device, float64 vs
float32, or which other layers exist. Scheme (Llama 3 / GPT-2): Normal(0, init_std), ``wo`` / ``w2``
scaled by 1 / sqrt(2 * n_layers) (Radford 2019), RMSNorm gains ones. ``hidden_std_factor`` multiplies
the std of the hidden matrices (every >= 2-D linear or expert weight but the embedding, the output
head and the router): muP's hidden init ~ 1 / sqrt(fan_in) (``training.mup_base_width``,
``ndtrain.optim.mup.hidden_init_factor``)."""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.norm import RMSNorm

# Wrapper prefixes that torch inserts into parameter names (activation checkpointing, torch.compile,
# FSDP1); removed so the init seed follows the model's own name.
_WRAPPER_TOKENS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_RESIDUAL_OUT = ("wo", "w2")
_NOT_HIDDEN = ("output", "router")  # width-free fan-in or fan-out: muP keeps their init


def canonical_name(name: str) -> str:
    """Name without wrapper tokens: ``layers.1._orig_mod.attention.wq.weight`` ->
    ``layers.1.attention.wq.weight``."""
    for tok in _WRAPPER_TOKENS:
        name = name.replace(tok, "")
    return name


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by a stable hash (BLAKE2b, 63 bits) of ``f"{seed}/{name}"``."""
    digest = hashlib.blake2b(f"{seed}/{canonical_name(name)}".encode(), digest_size=8).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return g


def _copy_full_(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size CPU tensor into ``p``; a DTensor parameter receives its own shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        full = distribute_tensor(full.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements)
    p.copy_(full)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, hidden_std_factor: float = 1.0) -> None:
    """Initialise ``model`` (a ``Transformer`` or stage) in place; ``hidden_std_factor`` as the module
    docstring. Raises NotImplementedError for an unknown module type's parameter (new types add a rule
    here instead of keeping ``to_empty`` garbage)."""
    cfg: ModelConfig = model.cfg
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for name, p in model.named_parameters():  # tied weights are listed once, under the embedding
        mod_name = name.rpartition(".")[0]
        mod = model.get_submodule(mod_name)
        shape = tuple(p.shape)  # global shape, also for DTensors
        if isinstance(mod, RMSNorm):
            full = torch.ones(shape, dtype=torch.float32)
        elif isinstance(mod, (nn.Linear, nn.Embedding)) or getattr(mod, "ndtrain_normal_init", False):
            std = cfg.init_std  # modules flagged ndtrain_normal_init (MoE experts) hold raw weights
            leaf = canonical_name(mod_name).rpartition(".")[2]
            if leaf in _RESIDUAL_OUT or (not isinstance(mod, nn.Linear) and name.rpartition(".")[2] in _RESIDUAL_OUT):
                std = std / math.sqrt(2 * cfg.n_layers)
            if len(shape) >= 2 and not isinstance(mod, nn.Embedding) and leaf not in _NOT_HIDDEN:
                std = std * hidden_std_factor
            full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=param_generator(seed, name))
        else:
            raise NotImplementedError(f"init_weights: no rule for {name} ({type(mod).__name__})")
        _copy_full_(p, full)
    for m in model.modules():  # buffers that are state, e.g. MoE expert biases
        if hasattr(m, "init_buffers"):
            m.init_buffers()
    if hasattr(model, "init_rope"):
        model.init_rope()


def count_params(model: nn.Module, include_embedding: bool = True) -> int:
    """Distinct parameters (tied once, DTensors by global size). ``include_embedding=False`` drops the
    input embedding (Kaplan 2020's non-embedding count); an untied head stays."""
    n = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None)
    if not include_embedding and emb is not None:
        n -= emb.weight.numel()
    return n
