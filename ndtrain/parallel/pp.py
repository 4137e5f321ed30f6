"""Pipeline stages: split the decoder's layers over the ``pp`` axis, build each stage on the meta
device with the single-process model's initial weights, and keep tied embeddings identical.

Placement (Megatron-LM interleaving, Narayanan et al. 2021): with ``v`` chunks per rank there are
``S = p * v`` virtual stages; rank r holds chunks c = 0..v-1, chunk c being virtual stage
``c * p + r``. Stage 0 also holds the token embedding, stage S-1 the final norm and output head.

Balance (Llama 3, 2024, took one block off the first and the last stage): layers are cut into S
contiguous runs minimising the largest per-stage cost (then the spread), where a block costs its
forward FLOPs per token (2 x parameters + 4 T C for attention scores and values) and the embedding
and the head each cost 2 V C, i.e. the embedding table is counted like a matmul of its size (its
memory and optimizer work scale with it; its lookup is free). Every stage keeps >= 1 block.

Names: a stage is a ``Transformer`` with the blocks it does not own deleted from its ``ModuleDict``
and ``tok_embeddings`` / ``norm`` / ``output`` set to None where not owned, so parameter names are
the full model's (checkpoints reshard across pp degrees) and ``init_weights`` (seeded per name)
gives each parameter exactly its single-process initial value.

Tied embeddings (``model.tie_embeddings``) across the first and last stage: each holds its own copy
(same init), and after each step's backward their gradients are summed over a 2-rank group
(``sync_tied_grads``), so the copies receive identical updates and stay equal.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ndtrain.config import Config, ModelConfig
from ndtrain.mesh import AXES, AxisGroup, Mesh
from ndtrain.optim import SHARD_AXES_ATTR, shard_axes
from ndtrain.parallel import comm

STAGE_ATTR = "ndtrain_pp_stage"


@dataclass
class StageInfo:
    """What one pp rank holds. ``chunks[c]``: the layer ids (ModuleDict keys) of virtual stage
    ``c * p + rank``. ``first`` / ``last``: holds virtual stage 0 / S-1 (embedding / head)."""

    rank: int
    p: int
    v: int
    chunks: list[list[str]]
    tied: bool

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.p - 1


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, list[float], float]:
    """Forward FLOPs per token of (embedding, each block, head); see the module docstring."""
    from ndtrain.model.transformer import TransformerBlock

    blocks = []
    with torch.device("meta"):
        for i in range(cfg.n_layers):
            n = sum(q.numel() for q in TransformerBlock(cfg, str(i)).parameters())
            blocks.append(2.0 * n + 4.0 * seq_len * cfg.dim)
    table = 2.0 * cfg.vocab_size * cfg.dim
    return table, blocks, table


def split_layers(blocks: list[float], n_stages: int, first_extra: float = 0.0,
                 last_extra: float = 0.0) -> list[list[int]]:
    """Cut ``blocks`` (per-block costs) into ``n_stages`` contiguous non-empty runs; stage 0 also
    costs ``first_extra`` and the last stage ``last_extra``. Minimises the largest stage cost, then
    the sum of squared stage costs (deterministic). Raises ValueError if len(blocks) < n_stages."""
    n = len(blocks)
    if n < n_stages:
        raise ValueError(f"n_layers ({n}) < pipeline stages pp * v ({n_stages})")
    pre = [0.0]
    for c in blocks:
        pre.append(pre[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        return (pre[j] - pre[i] + (first_extra if s == 0 else 0.0)
                + (last_extra if s == n_stages - 1 else 0.0))

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]  # best[s][j]: first j blocks in s stages
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                c = cost(s - 1, i, j)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    runs, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        runs.append(list(range(i, j)))
        j = i
    return runs[::-1]


def plan_stage(cfg: Config, rank: int) -> StageInfo:
    """The ``StageInfo`` of pp rank ``rank`` for ``cfg`` (pure; no process group)."""
    p, v = cfg.parallel.pp, cfg.parallel.pp_virtual_stages
    emb, blocks, head = layer_costs(cfg.model, cfg.data.seq_len)
    runs = split_layers(blocks, p * v, emb, head)
    chunks = [[str(i) for i in runs[c * p + rank]] for c in range(v)]
    return StageInfo(rank, p, v, chunks, cfg.model.tie_embeddings)


def _prune(model: nn.Module, info: StageInfo, keep_tied_holder: bool) -> None:
    """Delete what this rank does not own (in place). With ``keep_tied_holder`` the last stage of
    a tied model keeps ``tok_embeddings`` for now so ``init_weights`` ties and seeds the head under
    the embedding's name; ``_drop_tied_holder`` removes it afterwards."""
    own = {lid for chunk in info.chunks for lid in chunk}
    for lid in list(model.layers.keys()):
        if lid not in own:
            del model.layers[lid]
    if getattr(model, "mtp", None) is not None:
        model.mtp = None
    if not info.first and not (keep_tied_holder and info.tied and info.last):
        model.tok_embeddings = None
    if not info.last:
        model.norm = None
        model.output = None


def _drop_tied_holder(model: nn.Module, info: StageInfo) -> None:
    if not info.first and model.tok_embeddings is not None:
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
        if not (info.first and c == 0):
            view.tok_embeddings = None
        if not (info.last and c == info.v - 1):
            view.norm = None
            view.output = None
        views.append(view)
    return views


# --- tied embeddings across the first and last stage ----------------------------------------------
def build_tied_group(mesh: Mesh, cfg: Config) -> AxisGroup | None:
    """The 2-rank group {pp rank 0, pp rank p-1} of this rank's pipeline, when it holds one end of
    a tied embedding; else None. Collective: every rank of the world must call it (new_group)."""
    p = mesh.dims.pp
    if p == 1 or not cfg.model.tie_embeddings:
        return None
    pp = mesh.group("pp")
    if p == 2:
        return pp
    ranks = mesh.device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    firsts, lasts = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    mine = None
    me = dist.get_rank()
    for a, b in zip(firsts, lasts):  # same order on every rank
        pg = dist.new_group([a, b])
        if me in (a, b):
            mine = AxisGroup("pp", 2, 0 if me == a else 1, pg, pp.stats)
    return mine if pp.rank in (0, p - 1) else None


def tied_name(model: nn.Module) -> str | None:
    """Name of this stage's copy of the tied embedding: the embedding on the first stage, the head
    on the last, None elsewhere (or untied)."""
    info = stage_info(model)
    if info is None or not info.tied:
        return None
    return "tok_embeddings.weight" if info.first else ("output.weight" if info.last else None)


def grad_holder(model: nn.Module, dp, name: str) -> nn.Parameter:
    """The Parameter whose ``.grad`` the optimizer steps for model parameter ``name``: the model's
    own under plain data parallel, its master shard under ZeRO / FSDP (``dp.entries``, dim-0
    shards: the same rows of both tied copies sit on the same data-parallel rank)."""
    for e in getattr(dp, "entries", None) or []:
        if e.fqn == name or name in e.aliases:
            return e.param
    return model.get_parameter(name)


def sync_tied_grads(model: nn.Module, dp, group: AxisGroup | None) -> None:
    """Sum the tied embedding's gradient over the first and last stage (after the data-parallel
    reduction, on whatever the optimizer steps). Bytes: V x C x b per rank (2-rank all-reduce),
    divided by the data-parallel shard count under ZeRO / FSDP."""
    name = tied_name(model)
    if group is None or name is None:
        return
    w = grad_holder(model, dp, name)
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    comm.all_reduce(w.grad, group)


def _tied_head_alias(model: nn.Module | None) -> dict[str, str]:
    """{"output.weight": "tok_embeddings.weight"} on the last stage of a tied model, else {}."""
    info = stage_info(model) if model is not None else None
    return {"output.weight": "tok_embeddings.weight"} if (info and info.tied and not info.first
                                                         and info.last) else {}


def flatten_param_groups(optim_sd: dict, model: nn.Module | None = None) -> dict:
    """The optimizer state dict as checkpointed: ``param_groups`` keyed by parameter name
    (``{fqn: {"lr": ..., ...}}``, not a list of groups each listing its FQNs: pipeline stages hold
    different parameters, so one list -- one checkpoint key, saved once -- fits no other stage),
    and the last stage's tied head stored under the embedding's name, the name a single-process
    optimizer uses for the tied Parameter (both stages hold identical moments)."""
    alias = _tied_head_alias(model)
    out = dict(optim_sd)
    if alias and isinstance(out.get("state"), dict):
        out["state"] = {alias.get(k, k): v for k, v in out["state"].items()}
    groups = out.get("param_groups")
    if isinstance(groups, list):
        out["param_groups"] = {alias.get(f, f): {k: v for k, v in g.items() if k != "params"}
                               for g in groups for f in g["params"]}
    return out


def unflatten_param_groups(optim_sd: dict, template: dict, model: nn.Module | None = None) -> dict:
    """Inverse of ``flatten_param_groups``: the group lists of ``template`` (this layout's own
    ``optim_state_dict``), each group's hyperparameters taken from its first parameter's entry."""
    alias = _tied_head_alias(model)
    out = dict(optim_sd)
    if alias and isinstance(out.get("state"), dict):
        back = {v: k for k, v in alias.items()}
        out["state"] = {back.get(k, k): v for k, v in out["state"].items()}
    flat = out.get("param_groups")
    if isinstance(flat, dict):
        groups = []
        for g in template["param_groups"]:
            saved = next((flat[alias.get(f, f)] for f in g["params"] if alias.get(f, f) in flat), {})
            groups.append({**g, **saved, "params": g["params"]})
        out["param_groups"] = groups
    return out


def clip_grad_norm(model: nn.Module, dp, max_norm: float, mesh: Mesh) -> float:
    """Global-norm clipping over all stages: ``dp.clip_grad_norm`` sums squared norms over the
    parameters' shard axes (which include "pp"); the last stage's tied head is left out of the
    norm (its gradient equals the first stage's embedding gradient after ``sync_tied_grads``) and
    scaled with the same coefficient as ``ndtrain.optim.clip_grad_norm`` applies. Returns the norm
    before clipping."""
    info = stage_info(model)
    dup = grad_holder(model, dp, "output.weight") if (info and info.tied and info.last) else None
    held = None
    if dup is not None:
        held, dup.grad = dup.grad, None
    norm = dp.clip_grad_norm(max_norm, mesh)
    if dup is not None:
        dup.grad = held
        if held is not None and max_norm > 0 and norm > max_norm:
            held.mul_(max_norm / (norm + 1e-6))  # the coefficient of optim.clip_grad_norm
    return norm


class StagePipeline:
    """The trainer's view of pipeline parallel: this rank's stage model, its runtime, tied grads.

    Args: the stage ``model`` (after ``parallelize``), its gradient synchroniser ``dp``, ``mesh``,
    ``cfg``, ``loss_fn(logits, labels) -> sum CE`` (the layout's loss, e.g. vocab-parallel),
    ``forward_ctx`` (autocast factory), ``device``, ``m`` (microbatches per step).
    """

    def __init__(self, model: nn.Module, dp, mesh: Mesh, cfg: Config, loss_fn, forward_ctx,
                 device: torch.device, m: int):
        from ndtrain.parallel.pp_runtime import PipelineRuntime

        self.model, self.dp, self.mesh, self.m = model, dp, mesh, m
        self.tied_group = build_tied_group(mesh, cfg)
        self.runtime = PipelineRuntime(stage_chunks(model), mesh.group("pp"), cfg.parallel.pp_schedule,
                                       loss_fn, dp, forward_ctx, device, seed=cfg.training.seed)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, denom: float,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
        """All microbatches forward and backward, DP-reduced and tied-summed gradients in ``.grad``.
        Returns the summed token loss of the local batch (float64, the same on every pp rank)."""
        loss_sum = self.runtime.run(inputs, labels, self.m, denom, positions, train=True)
        sync_tied_grads(self.model, self.dp, self.tied_group)
        return loss_sum

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.model, self.dp, max_norm, self.mesh)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward-only pass of a local batch; the summed token loss on every pp rank."""
        return self.runtime.run(inputs, labels, min(self.m, inputs.shape[0]), 1.0, positions, train=False)


assert AXES[0] == "pp", "pp must stay the outermost mesh axis"
