"""Multi-token prediction (DeepSeek-V3, 2024, section 2.2; Gloeckle et al. 2024).

Depth k (1-based) combines the previous depth's state at i with the embedding of t_{i+k}:

    h'_i = W_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]          (2C -> C)
    h^k  = TransformerBlock_k(h'), over the T-k positions where t_{i+k} exists
    logits^k_i = OutputHead(RMSNorm_k(h^k_i))    predicts t_{i+k+1}

``h^0`` is the trunk's last hidden state before its final norm; embedding and head are shared.
Depth k's target at i is ``labels[i + k]``. Loss (eq. 24-25): ``lambda / D * sum_k L^k``, computed
in ``ndtrain.train.extras``. Under pp the modules sit on the head's stage, which keeps an
embedding copy and gets the token ids from the runtime (``feeding_token_ids``). Skipped at inference."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.block import TransformerBlock
from ndtrain.model.moe_balance import moe_layers
from ndtrain.model.norm import RMSNorm


class MTPModule(nn.Module):
    """One depth: ``hnorm``, ``enorm``, ``proj`` (C, 2C), ``block`` (same kind as the last layer), ``norm``.
    h (B, T', C), e (B, T', C), cos / sin (T', D/2) -> (B, T', C), before ``norm`` (the caller's)."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()

        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)  # (C, 2C)
        self.block = TransformerBlock(cfg, f"mtp{depth}", layer_index=cfg.n_layers - 1)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))  # (B, T', 2C) -> (B, T', C)
        return self.block(x, cos, sin)


MTP_TOKENS_ATTR = "ndtrain_mtp_token_ids"


def mtp_token_ids(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """The (B, T) ids MTP embeds: ``tokens`` when they are ids, else (a pp stage fed hidden states) the
    ids attached by ``feeding_token_ids``, or None."""
    if not tokens.is_floating_point():
        return tokens
    return getattr(model, MTP_TOKENS_ATTR, None)


@contextlib.contextmanager
def feeding_token_ids(model, ids: torch.Tensor):
    """Attach the microbatch's (B, T) ids to ``model`` for its forward (``mtp_token_ids``)."""
    setattr(model, MTP_TOKENS_ATTR, ids)
    try:
        yield
    finally:
        setattr(model, MTP_TOKENS_ATTR, None)


SHIFT_ATTR = "mtp_shift"  # optional model attribute: the sequence-shift hook (see ``shift_left``)


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x (B, T) -> (B, T): ``x[:, i + k]`` at i < T - k, ``fill`` at the last k. The single-device
    ``mtp_shift`` hook; cp installs one that fetches from the rank holding i + k."""
    k = min(k, x.shape[1])
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], dim=1)


def mtp_forward(model, tokens: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> list[torch.Tensor]:
    """Run ``model.mtp`` after the trunk. tokens (B, T), h (B, T, C), cos / sin (T, D/2) or (B, T, D/2).

    Returns D logits, depth k (B, T-k, V); with an ``mtp_shift`` hook (sp / cp) (B, T, V): the last k
    positions get a padding token and an ignored label, and are masked out of MoE routing
    (``MoE.token_mask``), so loss and MoE statistics are the truncated run's."""
    shift = getattr(model, SHIFT_ATTR, None)
    out = []
    t = tokens.shape[1]
    for k, module in enumerate(model.mtp.values(), start=1):
        if shift is not None:
            ids = shift(tokens, k, -1)  # (B, T): t_{i+k}, -1 where it does not exist (the last k)
            e = model.tok_embeddings(ids.clamp(min=0))  # (B, T, C): Emb(t_{i+k}), pad id 0 at the end
            with masking_moe(module, ids >= 0):
                h = module(h, e, cos, sin)  # (B, T, C)
        elif t - k <= 0:
            break
        else:
            e = model.tok_embeddings(tokens[:, k:])  # (B, T-k, C): Emb(t_{i+k})
            h = module(h[:, :t - k], e, cos[..., :t - k, :], sin[..., :t - k, :])  # (B, T-k, C)
        out.append(model.output(module.norm(h)))  # (B, T-k | T, V)
    return out


@contextlib.contextmanager
def masking_moe(module: nn.Module, valid: torch.Tensor):
    """``valid`` (B, T) bool as ``token_mask`` of every MoE layer in ``module`` during its forward (MTP
    blocks are not activation-checkpointed: no recompute runs after the mask is cleared)."""
    layers = moe_layers(module)
    for m in layers:
        m.token_mask = valid
    try:
        yield
    finally:
        for m in layers:
            m.token_mask = None


def _target(labels: torch.Tensor, k: int, length: int, shift, ignore_index: int) -> torch.Tensor:
    """Depth k's (B, length) targets: labels[:, k:] for truncated logits, else the shifted labels."""
    if length == labels.shape[1]:
        return (shift or shift_left)(labels, k, ignore_index)
    return labels[:, k:]


def mtp_loss_sums(mtp_logits: list[torch.Tensor], labels: torch.Tensor, ignore_index: int = -100,
                  shift=None, loss_sum=None) -> list[torch.Tensor]:
    """Per-depth summed cross-entropy (``logits^k[:, i]`` vs ``labels[:, i + k]``): labels (B, T) -> list
    of 0-d sums. ``shift``: the ``mtp_shift`` hook for (B, T, V) logits; ``loss_sum(logits, target)``:
    the summed token loss (tp passes its vocab-parallel one)."""
    sums = []
    for k, logits in enumerate(mtp_logits, start=1):
        target = _target(labels, k, logits.shape[1], shift, ignore_index)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if loss_sum is not None:
            sums.append(loss_sum(logits, target))
        else:
            sums.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=ignore_index,
                                        reduction="sum"))
    return sums


def mtp_valid_counts(labels: torch.Tensor, depth: int, ignore_index: int = -100, shift=None) -> list[int]:
    """Valid targets per depth 1..D of a (B, T) label batch (a collective under cp)."""
    if shift is None:
        return [int((labels[:, k:] != ignore_index).sum()) for k in range(1, depth + 1)]
    return [int((shift(labels, k, ignore_index) != ignore_index).sum()) for k in range(1, depth + 1)]
