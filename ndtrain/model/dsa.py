"""DeepSeek Sparse Attention (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp"), on GQA: a lightning indexer
scores every earlier key,

    I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s)      (H_I indexer heads, one shared indexer key)

and each query attends only to its top-k keys. ``topk_attention`` gathers them (O(T k));
``dense_topk_attention`` is its masked-full-attention twin. Selection passes no gradient, so the
indexer learns from its own loss: KL from the main attention's (detached) distribution over the
selected keys to softmax(I), on a detached input, summed over sequences (layout-independent),
entering backward through ``AttachLoss``. The dense warm-up stage is not built."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.attention import Attention
from ndtrain.model.documents import same_document
from ndtrain.model.rope import apply_rope


def select_topk(index_scores: torch.Tensor, top_k: int, q_offset: int = 0,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal top-k of ``index_scores`` (B, T, S) (query i at q_offset + i) -> idx (B, T, k') int64,
    valid (B, T, k') bool (False where fewer keys precede), k' = min(top_k, S). ``documents`` (B, S)
    ids (q_offset 0): keys of the query's document only."""
    t, s = index_scores.shape[1:]
    qi = torch.arange(t, device=index_scores.device)[:, None] + q_offset
    causal = torch.arange(s, device=index_scores.device)[None, :] <= qi  # (T, S)
    if documents is not None:
        causal = causal & same_document(documents, documents)[:, 0]  # (B, T, S)
    scores = index_scores.masked_fill(~causal, float("-inf"))
    top = scores.topk(min(top_k, s), dim=-1)
    return top.indices, torch.isfinite(top.values)


def dense_topk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                         valid: torch.Tensor) -> torch.Tensor:
    """Twin: q (B, H, T, D), k / v (B, G, S, D), idx / valid (B, T, k) -> (B, H, T, D), full attention
    under the selection mask."""
    b, t, _ = idx.shape
    mask = torch.zeros(b, t, k.shape[2], dtype=torch.bool, device=q.device)
    mask.scatter_(2, idx, valid)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1])


class AttachLoss(torch.autograd.Function):
    """fwd: ``x``; bwd: ``x``'s gradient, and gradient 1 for the 0-d ``loss`` (as if added to the
    objective)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.loss_meta
        return grad, torch.ones((), dtype=dtype, device=device)


def indexer_kl(picked_scores: torch.Tensor, valid: torch.Tensor, probs: torch.Tensor,
               reduce_heads=None) -> torch.Tensor:
    """Indexer loss (0-d): sum over sequences of the mean over queries of KL(p || softmax(I)) on the
    selected keys. picked_scores / valid (B, T, k); probs (B, G, R, T, k). ``reduce_heads``: adds the
    heads held elsewhere (tp's all-reduce), so p covers all H."""
    p = probs.detach().sum((1, 2))  # (B, T, k) summed over heads
    if reduce_heads is not None:
        p = reduce_heads(p)
    p = (p / p.sum(-1, keepdim=True)).to(picked_scores.dtype)
    logq = picked_scores.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
    kl = (p * (p.clamp_min(1e-30).log() - logq)).sum(-1)  # (B, T); p = 0 on unselected slots
    return kl.mean(-1).sum()


def topk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                   valid: torch.Tensor, return_probs: bool = False):
    """Gather the selected keys / values (B, G, T, k, D) and attend; ``return_probs`` adds (B, G, H/G, T,
    k)."""
    b, h, t, d = q.shape
    g, kk = k.shape[1], idx.shape[-1]
    gather = idx[:, None, :, :, None].expand(b, g, t, kk, d)  # (B, G, T, k, D)

    def pick(x: torch.Tensor) -> torch.Tensor:
        return torch.gather(x[:, :, None].expand(b, g, t, x.shape[2], d), 3, gather)

    ks, vs = pick(k), pick(v)  # (B, G, T, k, D)
    qg = q.view(b, g, h // g, t, d)  # (B, G, R, T, D)
    logits = torch.einsum("bgrtd,bgtkd->bgrtk", qg, ks) * d ** -0.5
    logits = logits.masked_fill(~valid[:, None, None], float("-inf"))
    wide = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype  # softmax in >= fp32
    probs = logits.to(wide).softmax(-1).to(q.dtype)
    out = torch.einsum("bgrtk,bgtkd->bgrtd", probs, vs).reshape(b, h, t, d)
    return (out, probs) if return_probs else out


class SparseAttention(Attention):
    """``Attention`` plus the indexer ``wq_index`` (C -> H_I*D), ``wk_index`` (C -> D), ``w_index``
    (C -> H_I); x (B, T, C), cos / sin (T, D/2) -> (B, T, C). Decoding caches indexer keys in
    ``kv_cache.states[layer_id]``."""

    def __init__(self, cfg, layer_id: str = "0"):
        super().__init__(cfg.dim, cfg.n_heads, cfg.kv_heads, layer_id)
        self.top_k, self.index_heads = cfg.dsa_top_k, cfg.dsa_index_heads
        # the KL target sums every head; tensor parallel (heads split) sets an all-reduce over tp here
        self.reduce_heads = None
        self.wq_index = nn.Linear(cfg.dim, cfg.dsa_index_heads * self.head_dim, bias=False)
        self.wk_index = nn.Linear(cfg.dim, self.head_dim, bias=False)
        self.w_index = nn.Linear(cfg.dim, cfg.dsa_index_heads, bias=False)

    def index_scores(self, x, cos, sin, k_index_past=None):
        """I (B, T, S) and this step's indexer keys (B, S, D) (past keys prepended when decoding)."""
        b, t, _ = x.shape
        qi = apply_rope(self.wq_index(x).view(b, t, -1, self.head_dim), cos, sin)  # (B, T, H_I, D)
        ki = apply_rope(self.wk_index(x).view(b, t, 1, self.head_dim), cos, sin)[:, :, 0]  # (B, T, D)
        if k_index_past is not None:
            ki = torch.cat([k_index_past, ki], dim=1)  # (B, S, D)
        per_head = F.relu(torch.einsum("btjd,bsd->btjs", qi, ki))  # (B, T, H_I, S)
        w = self.w_index(x) * self.index_heads ** -0.5  # (B, T, H_I)
        return torch.einsum("btj,btjs->bts", w, per_head), ki

    def forward(self, x, cos, sin, kv_cache=None, documents=None):
        q, k, v = self.project(x, cos, sin)  # (B, H|G, T, D)
        train_index = kv_cache is None and self.training and torch.is_grad_enabled()
        past = kv_cache.length if kv_cache is not None else 0
        prev = kv_cache.states.get(self.layer_id, {}).get("k_index") if past else None
        with torch.set_grad_enabled(train_index):  # the indexer learns only from its own loss
            scores, ki = self.index_scores(x.detach(), cos, sin, prev)  # (B, T, S)
        idx, valid = select_topk(scores.detach(), self.top_k, past, documents)  # discrete: no gradient
        if train_index:
            out, probs = topk_attention(q, k, v, idx, valid, return_probs=True)
            out = AttachLoss.apply(out, indexer_kl(scores.gather(-1, idx), valid, probs, self.reduce_heads))
        elif kv_cache is None:
            out = topk_attention(q, k, v, idx, valid)
        else:
            k, v = kv_cache.update(self.layer_id, k, v)  # (B, G, past + T, D)
            kv_cache.states[self.layer_id] = {"k_index": ki}
            out = dense_topk_attention(q, k, v, idx, valid)
        return self.merge(out)
