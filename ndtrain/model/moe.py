"""Mixture-of-Experts feed-forward: router, top-k routing, capacity, grouped SwiGLU experts (docs/moe.md).

Sparsely-gated MoE (Shazeer 2017); Mixtral's renormalised top-k (Jiang 2024); GShard / Switch
capacity (Lepikhin 2020, Fedus 2021); DeepSeekMoE's shared and fine-grained experts (Dai 2024);
DeepSeek-V3's sigmoid scores, group-limited routing and aux-loss-free bias. The N*k assignments
are sorted by expert and run as one ``grouped_mm`` (slow twin ``grouped_mm_loop``, always for
float64). ``token_mask`` (B, T): tokens that route nowhere and leave every statistic (MTP's padded
tail). ``experts`` is what ep replaces per instance; this file never communicates."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model import moe_autograd, moe_balance
from ndtrain.model.mlp import FeedForward
from ndtrain.model.moe_balance import moe_layers  # also re-exported
from ndtrain.model.moe_capacity import SequenceShards, balanced_assignment, capacity_keep


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference grouped matmul. x (M, K) sorted by group, w (E, N, K) (``nn.Linear`` layout), counts: E
    Python ints summing to M -> (M, N), row r of group e = ``x[r] @ w[e].T``. An empty segment still
    gives its expert a zero gradient (never None)."""
    outs, off = [], 0
    for e, n in enumerate(counts):
        outs.append(x[off:off + n] @ w[e].t())  # (n, N)
        off += n
    return torch.cat(outs, dim=0)


def _fused_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0)):
        return False  # the CUDA kernel is bf16-only, Hopper or newer
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # torch.compile's fake-tensor kernel of _grouped_mm takes bf16 only
    align = 16 // x.element_size()  # the kernel needs 16-byte aligned row strides
    return x.shape[0] > 0 and x.shape[1] % align == 0 and w.shape[1] % align == 0


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (M, K) sorted by group, w (E, N, K), counts (E,) int64, impl auto | loop | fused -> (M, N).
    Raises RuntimeError if ``impl == "fused"`` but ``torch._grouped_mm`` cannot run here."""
    w = w.to(x.dtype) if w.dtype != x.dtype else w  # bf16 autocast does not cover _grouped_mm
    if impl == "loop" or (impl == "auto" and not _fused_ok(x, w)):
        return grouped_mm_loop(x, w, counts.tolist())
    if not _fused_ok(x, w):
        raise RuntimeError(f"torch._grouped_mm cannot run on {x.dtype} {tuple(x.shape)} x {tuple(w.shape)}")
    offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,) end row of each group
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))  # (M, N)


def keep_best_blocks(choice: torch.Tensor, blocks: int, keep: int) -> torch.Tensor:
    """choice (N, E) -> choice with every expert outside the ``keep`` best of ``blocks`` contiguous
    expert blocks set to -inf. Block score: the sum of its two best entries (DeepSeek-V3's code for
    group-limited routing; its node-limited routing uses the same rule with a node's experts as a group)."""
    n, e = choice.shape
    grouped = choice.view(n, blocks, e // blocks)  # (N, G, E/G)
    gscore = grouped.topk(min(2, e // blocks), dim=-1).values.sum(-1)  # (N, G)
    mask = torch.zeros_like(gscore, dtype=torch.bool)
    mask.scatter_(1, gscore.topk(keep, dim=-1).indices, True)
    return choice.masked_fill(~mask.unsqueeze(-1).expand_as(grouped).reshape(n, e), float("-inf"))


def set_route_nodes(model: nn.Module, nodes: int) -> None:
    """Give every MoE layer of ``model`` ``nodes`` node blocks for ``model.moe_max_nodes`` (a one-process
    model then routes as a layout whose ep group spans ``nodes`` nodes). Raises ValueError if ``nodes``
    does not divide the experts."""
    for m in moe_layers(model):
        if m.n_experts % nodes:
            raise ValueError(f"moe_experts ({m.n_experts}) is not divisible by the {nodes} route nodes")
        m.route_nodes = nodes


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (``_grouped_mm`` rejects stride 0)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: ``w1`` / ``w3`` (E, F, C), ``w2`` (E, C, F). xs (M, C) sorted
    by expert, counts (E,) -> (M, C). E is read from the weights (expert parallel keeps a slice)."""

    ndtrain_normal_init = True  # init.py: normal(0, init_std); w2 scaled like other residual outputs

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate (E, F, C)
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up   (E, F, C)
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down (E, C, F)
        self.impl = "auto"  # auto | loop | fused (see grouped_mm)

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        h = F.silu(grouped_mm(xs, self.w1, counts, self.impl)) * grouped_mm(xs, self.w3, counts, self.impl)
        return grouped_mm(h, self.w2, counts, self.impl)  # (M, F) -> (M, C)


class MoE(nn.Module):
    """Routed (+ optional shared) experts replacing a block's feed-forward; x (B, T, C) -> (B, T, C).

    ``router`` C -> E runs in float32 (float64 in a float64 model); ``shared`` FeedForward or None;
    ``shared_gate`` C -> 1 or None (Qwen3-Next's sigmoid gate); buffer ``expert_bias`` (E,). Training
    forwards record the aux-loss token sums (``aux_sum``) and load statistics (``moe_balance``);
    capacity dropping applies in training only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)  # (E, C)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared = FeedForward(cfg.dim, cfg.shared_ffn_dim) if cfg.moe_shared_experts else None
        # Qwen3-Next: the shared output is scaled per token by sigmoid(x w_g), w_g (1, C)
        gated = cfg.moe_shared_gate and self.shared is not None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if gated else None
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
        self.load_reducer = None  # set by parallel code: sums a (E,) count tensor over the aux-loss scope's ranks
        self.seq_shards: SequenceShards | None = None  # set under cp: how each sequence is split over ranks
        self.stats = moe_balance.LoadStats(cfg.moe_experts)
        self.aux_sum: torch.Tensor | None = None  # weighted aux-loss token sum of the last forward
        self.token_mask: torch.Tensor | None = None  # (B, T) bool, routed tokens; None = all (docstring)
        self.shared_overlap = False  # set by expert parallel (parallel.moe_shared_overlap); docstring
        self.routing = "learned"  # learned | balanced (training.moe_routing, set by the trainer)
        # node-limited routing's node count (contiguous expert blocks): set by expert parallel from the
        # layout (ep / node_size), or by set_route_nodes to replay a layout's routing in one process
        self.route_nodes = 1

    def init_buffers(self) -> None:
        """Zero the aux-loss-free bias (called by ``init_weights``)."""
        self.expert_bias.zero_()

    # ---- routing ---------------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, C) -> logits (N, E) in float32 (float64 for a float64 model); autocast disabled.
        Backward keeps x and the weight as given, not their float32 casts (``moe_autograd``)."""
        rdt = torch.promote_types(self.router.weight.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return moe_autograd.router_logits(x, self.router.weight, rdt)

    def route(self, logits: torch.Tensor, forced: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits (N, E) -> scores (N, E), idx (N, k) int64 (descending biased score), weights (N, k).

        Selection uses ``scores + expert_bias`` within the ``moe_max_nodes`` best of the ``route_nodes``
        node blocks (when fewer than all), then within the ``moe_topk_groups`` best of ``moe_n_groups``
        groups (block score: sum of its two best biased scores, DeepSeek-V3); weights are the unbiased
        scores, renormalised if ``moe_renormalize``, times ``moe_route_scale``. ``forced`` (N, k): the
        experts to use instead of the selection (balanced routing); weights are taken the same way."""
        c = self.cfg
        scores = logits.softmax(-1) if c.moe_score == "softmax" else logits.sigmoid()  # (N, E)
        choice = scores.detach() + self.expert_bias.to(scores.dtype)  # (N, E)
        if c.moe_max_nodes > 0 and self.route_nodes > c.moe_max_nodes:  # node-limited, then group-limited
            choice = keep_best_blocks(choice, self.route_nodes, c.moe_max_nodes)
        if c.moe_n_groups > 1:
            choice = keep_best_blocks(choice, c.moe_n_groups, c.moe_topk_groups)
        idx = choice.topk(self.top_k, dim=-1).indices if forced is None else forced  # (N, k)
        weights = scores.gather(1, idx)  # (N, k)
        if c.moe_renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, idx, weights * c.moe_route_scale

    def capacity_keep(self, idx: torch.Tensor, shape: tuple[int, int] | None = None,
                      valid: torch.Tensor | None = None) -> torch.Tensor | None:
        """keep (N, k) bool: assignments within capacity ``ceil(cf * B T k / E)`` (None: dropless or eval).
        GShard priority; under cp the single process's decision (``moe_capacity``). idx (N, k), shape
        (B, T_local) (default (1, N)), valid (N,) bool or None."""
        cf = self.cfg.moe_capacity_factor
        if cf <= 0 or not self.training:
            return None
        return capacity_keep(idx, shape or (1, idx.shape[0]), self.n_experts, cf, self.seq_shards, valid)

    # ---- experts ---------------------------------------------------------------------------------
    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs (M, C) sorted by expert id, counts (E,) -> (M, C). Expert parallel replaces ``experts``."""
        return self.experts(xs, counts)

    def shared_output(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared experts' output, times the Qwen3-Next gate if any: flat (N, C) -> (N, C)."""
        shared = self.shared(flat)  # (N, C)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(flat)) * shared
        return shared

    def _routed_output(self, flat: torch.Tensor, xs: torch.Tensor, counts: torch.Tensor, order: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The routed experts' weighted sum (N, C) in ``flat``'s dtype, and the shared output when it ran
        overlapped with the dispatch (else None). xs (M, C) = flat rows in expert order, order (M,)
        their assignment positions (token * k + slot), weights (N, k)."""
        n, k, c = flat.shape[0], self.top_k, flat.shape[1]
        if getattr(self.experts, "weights_inside", False):  # hierarchical dispatch: weighted sums per node
            ys = self.experts(xs, counts, weights.reshape(-1)[order], order // k)  # (M, C)
            y = moe_autograd.scatter_rows(ys, order, n * k)  # (N*k, C): a token's sums, other rows 0
            return y.view(n, k, c).sum(1).to(flat.dtype), None
        shared = None
        if self.shared is not None and self.shared_overlap and getattr(self.experts, "accepts_side_fn", False):
            # after the caller's gather, so the input's gradient still sums in the same order (overlap docstring)
            ys, shared = self.experts(xs, counts, side_fn=lambda: self.shared_output(flat))
        else:
            ys = self.run_experts(xs, counts)  # (M, C)
        y = moe_autograd.scatter_rows(ys, order, n * k)  # (N*k, C), dropped rows stay 0
        # weighted in the scores' float32; backward keeps y in the experts' dtype (moe_autograd)
        return moe_autograd.weighted_sum(y.view(n, k, c), weights, flat.dtype), shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_tokens(x, self.token_mask)

    def forward_tokens(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """x (B, T, C), valid (B, T) bool or None -> (B, T, C). Raises ValueError if ``valid`` is not (B,
        T)."""
        b, t, c = x.shape
        if valid is not None and tuple(valid.shape) != (b, t):
            raise ValueError(f"MoE token mask {tuple(valid.shape)} does not match the tokens {(b, t)}")
        flat = x.reshape(-1, c)  # (N, C)
        n, k, e = flat.shape[0], self.top_k, self.n_experts
        logits = self.router_logits(flat)  # (N, E)
        forced = None
        if self.routing == "balanced":  # benchmarks only: round-robin by sequence position (moe_capacity)
            forced = balanced_assignment((b, t), k, e, self.seq_shards, flat.device)
        scores, idx, weights = self.route(logits) if forced is None else self.route(logits, forced)
        valid = None if valid is None else valid.reshape(-1)  # (N,)
        # the unmasked call keeps capacity_keep's two-argument form, which tests wrap to record decisions
        keep = self.capacity_keep(idx, (b, t)) if valid is None else self.capacity_keep(idx, (b, t), valid)
        if keep is None and valid is not None:
            keep = valid.unsqueeze(1).expand(n, k)  # dropless: every valid assignment is kept
        assign = idx.reshape(-1)  # (N*k,) expert of assignment (token i, slot j) at i*k + j
        if keep is not None:
            assign = assign.masked_fill(~keep.reshape(-1), e)  # dropped / masked -> sentinel E, sorts last
        order = torch.argsort(assign, stable=True)  # (N*k,)
        counts = torch.bincount(assign, minlength=e + 1)[:e]  # (E,) kept assignments per expert
        kept = int(counts.sum())
        order = order[:kept]
        xs = flat[order // k]  # (M, C) tokens in expert order
        out, shared = self._routed_output(flat, xs, counts, order, weights)  # (N, C), overlapped shared or None
        if self.shared is not None:
            out = out + (self.shared_output(flat) if shared is None else shared)
        if self.training and torch.is_grad_enabled():
            # An activation-checkpoint recompute (inside backward) rebuilds the same aux graph, so
            # the recomputed saved tensors line up, but must not count loads or losses twice.
            first = torch._C._current_graph_task_id() == -1
            aux = moe_balance.record(self, logits, scores, idx, keep, (b, t), update_stats=first, valid=valid)
            if first:
                self.aux_sum = aux
        return out.view(b, t, c)
