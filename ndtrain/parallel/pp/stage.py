"""Pipeline stages: split the layers over ``pp`` and build each stage on meta with the single-process
initial weights (docs/pipeline_parallel.md, "Stages").

Rank r's chunk c is virtual stage ``c * p + r`` (Megatron-LM, Narayanan et al. 2021; DualPipeV: r
and 2p-1-r). Stage 0 holds the embedding, stage S-1 the norm, head, MTP modules and an embedding
copy for their lookup. The blocks of each virtual stage: ``parallel.pp_layout`` when set
(``layout.py``), else balanced (Llama 3, 2024): contiguous runs minimising the largest forward
FLOPs per token (2 x active parameters + attention's 4 T C; embedding and head 2 V C each), the end
stages holding only the embedding / head when there are one or two blocks fewer than stages. A stage
is a ``Transformer`` with what it does not own deleted or None, so names are the full model's and
``init_weights`` (seeded per name) gives single-process values."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ndtrain.mesh import AXES, Mesh
from ndtrain.mixer_spec import stage_seq_costs
from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel.pp.layout import balanced_runs, layout_runs, split_layers  # noqa: F401  (split_layers: tests)

if TYPE_CHECKING:  # annotations only: the config package validates with parallel's rules
    from ndtrain.config import Config, ModelConfig

STAGE_ATTR = "ndtrain_pp_stage"
RELEASE_SENT = True  # False: keep each sent output whole until its backward (the reference in tests)


@dataclass
class StageInfo:
    """What one pp rank holds: ``chunks[c]``, the layer ids of its virtual stages; ``first`` / ``last``:
    holds stage 0 / S-1; ``mtp``: MTP modules and an embedding copy sit with the head."""

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
        """The head's stage holds an embedding copy and is not the first: gradients summed between the two."""
        return (self.tied or self.mtp) and not self.vshape and self.p > 1


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """Forward FLOPs per token of (embedding, each block, head)."""
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
    """Parameters one token uses in ``block``: an MoE feed-forward counts k / E of its ``experts``."""
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
    runs = stage_runs(cfg, p * v)
    ids = [rank, 2 * p - 1 - rank] if vshape else [c * p + rank for c in range(v)]
    chunks = [[str(i) for i in runs[s]] for s in ids]
    return StageInfo(rank, p, v, chunks, cfg.model.tie_embeddings, vshape, cfg.model.mtp_depth > 0)


def stage_runs(cfg: Config, n_stages: int) -> list[list[int]]:
    """Block ids of each of the ``n_stages`` virtual stages: ``parallel.pp_layout`` when set, else
    balanced by ``layer_costs``. Raises ConfigError on a layout that does not fit the model."""
    layout = getattr(cfg.parallel, "pp_layout", "")
    if layout:
        return layout_runs(layout, n_stages, cfg.model.n_layers, cfg.model.mtp_depth)
    key = (repr(cfg.model), cfg.data.seq_len)  # every rank's plan needs every block's cost: build once
    if key not in _COSTS:
        _COSTS.clear()  # one model at a time is enough (rehearsal roles, calibration)
        _COSTS[key] = layer_costs(cfg.model, cfg.data.seq_len)
    emb, blocks, head = _COSTS[key]
    return balanced_runs(blocks, n_stages, emb, head)


_COSTS: dict[tuple[str, int], tuple[float, list[float], float]] = {}


def _prune(model: nn.Module, info: StageInfo, keep_tied_holder: bool) -> None:
    """Delete what this rank does not own (in place). ``keep_tied_holder`` keeps ``tok_embeddings`` on a
    tied last stage so ``init_weights`` seeds the head under the embedding's name; removed afterwards."""
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
                         seed: int, hidden_std_factor: float = 1.0) -> nn.Module:
    """This rank's stage: built on meta, pruned, materialised, ``init_weights(seed)`` (single-process
    values)."""
    from ndtrain.model.transformer import Transformer

    info = plan_stage(cfg, mesh.group("pp").rank)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    _prune(model, info, keep_tied_holder=True)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.init_weights(seed, hidden_std_factor)
    _drop_tied_holder(model, info)
    setattr(model, STAGE_ATTR, info)
    return model.train()


def apply_pipeline(model: nn.Module, mesh: Mesh, cfg: Config) -> None:
    """Make ``model`` this rank's stage in place (no-op if built by ``build_pipeline_stage``)."""
    if mesh.dims.pp == 1 or hasattr(model, STAGE_ATTR):
        return
    info = plan_stage(cfg, mesh.group("pp").rank)
    _prune(model, info, keep_tied_holder=False)
    setattr(model, STAGE_ATTR, info)


def stage_info(model: nn.Module) -> StageInfo | None:
    return getattr(model, STAGE_ATTR, None)


def tag_pipeline_params(model: nn.Module) -> None:
    """Add "pp" to every parameter's shard axes (squared grad norms are summed over pp). Call after
    TP / EP, which replace and re-tag parameters."""
    for q in model.parameters():
        axes = shard_axes(q)
        if "pp" not in axes:
            setattr(q, SHARD_AXES_ATTR, tuple(axes) + ("pp",))


def release_sent_output(out: torch.Tensor) -> None:
    """Free a non-last stage's output once it is handed to the send (Megatron-LM's
    ``deallocate_output_tensor``; Llama 3 frees sent outputs too). Its backward needs only the
    autograd node and the shape: ``out`` keeps both (shape and dtype over a one-element storage,
    stride 0), so ``backward(out, grad)`` still checks the received gradient's shape; the send holds
    the data until it completes (``p2p.send_tensor`` keeps a reference). Without it each in-flight
    (microbatch, chunk) keeps its (B, T[/tp], C) output, as much as a block input under full
    checkpointing. Leaves (a chunk that passed its input on) and views (whose base owns the
    storage) are left alone."""
    if not RELEASE_SENT or out.grad_fn is None or out._base is not None:
        return
    out.data = out.new_empty(()).expand(out.shape)


def stage_chunks(model: nn.Module) -> list[nn.Module]:
    """Modules running this rank's virtual stages, chunk order: the stage itself for v == 1, else
    shallow views sharing its submodules and hooks. Build after ``parallelize`` (it replaces
    submodules)."""
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
