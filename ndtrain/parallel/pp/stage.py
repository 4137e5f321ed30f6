"""Pipeline stages: split the decoder's layers over the ``pp`` axis, build each stage on the meta
device with the single-process model's initial weights, and keep tied embeddings identical.

Placement (Megatron-LM interleaving, Narayanan et al. 2021): with ``v`` chunks per rank there are
``S = p * v`` virtual stages; rank r holds chunks c = 0..v-1, chunk c being virtual stage
``c * p + r``. Stage 0 also holds the token embedding, stage S-1 the final norm and output head.
DualPipeV (``pp_schedule=dualpipev``, DeepSeek-V3 2024): 2 chunks per rank placed as a V, rank r
holding stages r and 2p-1-r, so rank 0 holds both the embedding and the head.
MTP modules (DeepSeek-V3 multi-token prediction) live on the stage of the head; they embed the
shifted tokens, so that stage keeps a copy of the embedding (``tok_embeddings``, not used for its
input) whose gradient is summed with the first stage's like a tied head's (``pipeline``).

Balance (Llama 3, 2024, took one block off the first and the last stage): layers are cut into S
contiguous runs minimising the largest per-stage cost (then the spread), where a block costs its
forward FLOPs per token (2 x *active* parameters -- an MoE block counts its shared experts,
router and top-k routed experts, not all E, so dense blocks such as DeepSeek-V3's first three weigh
what they compute -- + 4 T C for attention scores and values; a token mixer's own term for the
other layers, ``mixer_spec.stage_seq_costs``: none for linear ones) and the embedding and the head
each cost 2 V C, i.e. the embedding table is counted like a matmul of its size (its memory and
optimizer work scale with it; its lookup is free); each MTP depth adds to the head's stage its
block (active), its projection (2C x C) and one more head matmul (2 V C). Every stage keeps >= 1
block.

Names: a stage is a ``Transformer`` with the blocks it does not own deleted from its ``ModuleDict``
and ``tok_embeddings`` / ``norm`` / ``output`` set to None where not owned, so parameter names are
the full model's (checkpoints reshard across pp degrees) and ``init_weights`` (seeded per name)
gives each parameter exactly its single-process initial value.

Tied embeddings (``model.tie_embeddings``) across the first and last stage: each holds its own copy
(same init), and after each step's backward their gradients are summed over a 2-rank group
(``pp_train.sync_tied_grads``), so the copies receive identical updates and stay equal.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ndtrain.mesh import AXES, Mesh
from ndtrain.mixer_spec import stage_seq_costs
from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel.pp.rules import split_layers  # the one split rule (the planner's too)

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config, ModelConfig

STAGE_ATTR = "ndtrain_pp_stage"


@dataclass
class StageInfo:
    """What one pp rank holds. ``chunks[c]``: the layer ids (ModuleDict keys) of virtual stage
    ``c * p + rank`` (V placement: chunk 0 / 1 = stage rank / 2p-1-rank). ``first`` / ``last``:
    holds virtual stage 0 / S-1 (embedding / head). ``mtp``: the model has MTP modules (they and a
    copy of the embedding sit with the head)."""

    rank: int
    p: int
    v: int
    chunks: list[list[str]]
    tied: bool
    vshape: bool = False
    mtp: bool = False

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == (0 if self.vshape else self.p - 1)

    @property
    def shares_embedding(self) -> bool:
        """The head's stage holds its own copy of the embedding (tied head, or MTP's lookup) and is
        not the first stage: the copies' gradients are summed between the two ranks."""
        return (self.tied or self.mtp) and not self.vshape and self.p > 1


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """Forward FLOPs per token of (embedding, each block, head); see the module docstring."""
    from ndtrain.model.transformer import TransformerBlock

    blocks = []
    seq = stage_seq_costs(cfg, seq_len)  # per layer by its token mixer (no T term for linear ones)
    with torch.device("meta"):
        for i in range(cfg.n_layers):
            blocks.append(2.0 * active_params(TransformerBlock(cfg, str(i))) + seq[i])
        last = TransformerBlock(cfg, "mtp", layer_index=cfg.n_layers - 1) if cfg.mtp_depth else None
    table = 2.0 * cfg.vocab_size * cfg.dim
    mtp = 0.0
    if last is not None:  # per depth: block, projection (C, 2C), norms, one more head matmul
        mtp = cfg.mtp_depth * (2.0 * (active_params(last) + 2 * cfg.dim * cfg.dim + 3 * cfg.dim)
                               + seq[-1] + table)
    return table, blocks, table + mtp


def active_params(block: nn.Module) -> float:
    """Parameters one token uses in ``block``: all, less the routed experts it is not sent to (an
    MoE feed-forward's (E - k) / E of its ``experts``)."""
    n = float(sum(q.numel() for q in block.parameters()))
    ff = getattr(block, "feed_forward", None)
    if ff is not None and hasattr(ff, "experts") and hasattr(ff, "top_k"):
        routed = sum(q.numel() for q in ff.experts.parameters())
        n -= routed * (ff.n_experts - ff.top_k) / ff.n_experts
    return n


def plan_stage(cfg: Config, rank: int) -> StageInfo:
    """The ``StageInfo`` of pp rank ``rank`` for ``cfg`` (pure; no process group)."""
    p, v = cfg.parallel.pp, cfg.parallel.pp_virtual_stages
    vshape = cfg.parallel.pp_schedule == "dualpipev" and p > 1
    v = 2 if vshape else v
    emb, blocks, head = layer_costs(cfg.model, cfg.data.seq_len)
    runs = split_layers(blocks, p * v, emb, head)
    ids = [rank, 2 * p - 1 - rank] if vshape else [c * p + rank for c in range(v)]
    chunks = [[str(i) for i in runs[s]] for s in ids]
    return StageInfo(rank, p, v, chunks, cfg.model.tie_embeddings, vshape, cfg.model.mtp_depth > 0)


def _prune(model: nn.Module, info: StageInfo, keep_tied_holder: bool) -> None:
    """Delete what this rank does not own (in place). With ``keep_tied_holder`` the last stage of
    a tied model keeps ``tok_embeddings`` for now so ``init_weights`` ties and seeds the head under
    the embedding's name; ``_drop_tied_holder`` removes it afterwards."""
    own = {lid for chunk in info.chunks for lid in chunk}
    for lid in list(model.layers.keys()):
        if lid not in own:
            del model.layers[lid]
    if getattr(model, "mtp", None) is not None and not info.last:
        model.mtp = None
    holder = info.last and (info.mtp or (keep_tied_holder and info.tied))
    if not info.first and not holder:
        model.tok_embeddings = None
    if not info.last:
        model.norm = None
        model.output = None


def _drop_tied_holder(model: nn.Module, info: StageInfo) -> None:
    if not info.first and not info.mtp and model.tok_embeddings is not None:
        model.tok_embeddings = None  # output.weight keeps the (tied) Parameter and its values


def build_pipeline_stage(cfg: Config, mesh: Mesh, device: torch.device, dtype: torch.dtype,
                         seed: int) -> nn.Module:
    """This rank's stage: built on meta, pruned, materialised on ``device`` in ``dtype``, initialised
    with ``init_weights(seed)`` (per-name seeds, so identical to the single-process model's)."""
    from ndtrain.model.transformer import Transformer

    info = plan_stage(cfg, mesh.group("pp").rank)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    _prune(model, info, keep_tied_holder=True)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.init_weights(seed)
    _drop_tied_holder(model, info)
    setattr(model, STAGE_ATTR, info)
    return model.train()


def apply_pipeline(model: nn.Module, mesh: Mesh, cfg: Config) -> None:
    """Make ``model`` this rank's stage in place: a no-op for a model from ``build_pipeline_stage``;
    a full materialised ``Transformer`` is pruned (its tied head keeps the embedding's values)."""
    if mesh.dims.pp == 1 or hasattr(model, STAGE_ATTR):
        return
    info = plan_stage(cfg, mesh.group("pp").rank)
    _prune(model, info, keep_tied_holder=False)
    setattr(model, STAGE_ATTR, info)


def stage_info(model: nn.Module) -> StageInfo | None:
    return getattr(model, STAGE_ATTR, None)


def tag_pipeline_params(model: nn.Module) -> None:
    """Add "pp" to every parameter's shard axes (stages hold disjoint parameters, so squared grad
    norms are summed over pp). Call after TP / EP, which replace and re-tag parameters."""
    for q in model.parameters():
        axes = shard_axes(q)
        if "pp" not in axes:
            setattr(q, SHARD_AXES_ATTR, tuple(axes) + ("pp",))


def stage_chunks(model: nn.Module) -> list[nn.Module]:
    """Modules running this rank's virtual stages, chunk order. For v == 1 the stage itself; for
    v > 1 shallow views of it sharing its submodules, parameters and hooks, each with only its
    chunk's blocks (and the embedding / head only on virtual stage 0 / S-1). Build the views after
    ``parallelize`` (it may replace submodules)."""
    info = stage_info(model)
    if info is None or info.v == 1:
        return [model]
    views = []
    for c, ids in enumerate(info.chunks):
        view = copy.copy(model)
        view._modules = dict(model._modules)  # own registry; the modules themselves are shared
        view.layers = nn.ModuleDict({lid: model.layers[lid] for lid in ids})
        head = info.last and c == info.v - 1
        if not (info.first and c == 0) and not (head and info.mtp):
            view.tok_embeddings = None  # the head's chunk keeps it for MTP's lookup
        if not head:
            view.norm = None
            view.output = None
            if getattr(view, "mtp", None) is not None:
                view.mtp = None
        views.append(view)
    return views


assert AXES[0] == "pp", "pp must stay the outermost mesh axis"
