"""Multi-token prediction (MTP; DeepSeek-V3, 2024, section 2.2; Gloeckle et al. 2024 for the idea).

D sequential modules extend the main model's prediction depth. Module k (1-based) combines the
previous depth's representation of position i with the embedding of token t_{i+k}:

    h'_i = W_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]          (2C -> C)
    h^k  = TransformerBlock_k(h'), over the T-k positions where t_{i+k} exists
    logits^k_i = OutputHead(RMSNorm_k(h^k_i))    predicts t_{i+k+1}

``h^0`` is the main model's last hidden state before its final norm. The embedding and the output
head are the main model's (shared), so gradients of the MTP loss reach them. With the main
model's labels ``labels[i] = t_{i+1}``, depth k's target at position i is ``labels[i + k]``.

Pipeline parallel: the modules sit on the stage of the head, which also keeps a copy of the
embedding for the lookup of the shifted tokens (``ndtrain.parallel.pp.stage``); that stage's input
is hidden states, so the runtime hands it the token ids (``feeding_token_ids``).

Loss (DeepSeek-V3 eq. 24-25): ``lambda / D * sum_k L^k`` with ``L^k`` the token-weighted mean
cross-entropy of depth k over the global batch (``ndtrain.train.extras`` computes it). At inference
the modules are skipped (they could serve speculative decoding; not implemented).
"""
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
    """One MTP depth: ``hnorm``, ``enorm``, ``proj`` (C, 2C), ``block`` (a decoder block of the same
    kind as the model's last layer), ``norm``.

    Shapes: h (B, T', C) previous depth, e (B, T', C) embeddings of the shifted tokens, cos / sin
    (T', D/2) -> (B, T', C) (pre-norm hidden of this depth; ``norm`` is applied by the caller).
    """

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
    """Placement hook: the (B, T) token ids MTP embeds. ``tokens`` themselves when they are ids;
    when they are hidden states (a pipeline stage holding the head, fed by the previous stage),
    the ids the pipeline runtime attached with ``feeding_token_ids``, else None."""
    if not tokens.is_floating_point():
        return tokens
    return getattr(model, MTP_TOKENS_ATTR, None)


@contextlib.contextmanager
def feeding_token_ids(model, ids: torch.Tensor):
    """Attach the microbatch's (B, T) token ids to ``model`` (a pipeline stage holding the head and
    MTP modules) for the duration of its forward; see ``mtp_token_ids``."""
    setattr(model, MTP_TOKENS_ATTR, ids)
    try:
        yield
    finally:
        setattr(model, MTP_TOKENS_ATTR, None)


SHIFT_ATTR = "mtp_shift"  # optional model attribute: the sequence-shift hook (see ``shift_left``)


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x (B, T) -> (B, T): ``x[:, i + k]`` at i < T - k, ``fill`` at the last k positions.

    The single-device form of the ``mtp_shift`` hook. A layout whose ranks hold only part of each
    sequence (context parallel) installs its own hook with this signature, which fetches the
    tokens at i + k from the rank holding them (``ndtrain.parallel.cp.mtp_shift``)."""
    k = min(k, x.shape[1])
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], dim=1)


def mtp_forward(model, tokens: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> list[torch.Tensor]:
    """Run ``model.mtp`` after the main trunk.

    Args: tokens (B, T) input ids; h (B, T, C) last hidden before the final norm; cos / sin (T, D/2)
    or (B, T, D/2) at the input positions.
    Returns: D logits tensors, depth k (1-based) of shape (B, T-k, V); when the model has an
    ``mtp_shift`` hook (set by sequence / context parallel, whose ranks hold a slice of the
    positions), (B, T, V) instead: every depth runs on all positions with the shifted tokens
    (``shift_left``) and the last k positions, whose token t_{i+k} does not exist, get a padding
    token and an ignored label. Causal attention keeps them out of the real positions, so the loss
    is the truncated one; MoE layers of the depth's block get those positions masked
    (``MoE.token_mask``), so their routing, capacity, balance losses and loads are the truncated
    run's too.
    """
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
    """Set ``valid`` (B, T) bool as the ``token_mask`` of every MoE layer inside ``module`` for the
    duration of its forward (``ndtrain.model.moe``; a no-op for dense blocks). The MTP blocks are
    not activation-checkpointed, so no recompute runs after the mask is cleared."""
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
    """Summed cross-entropy of each depth: depth k (1-based) scores ``logits^k[:, i]`` against
    ``labels[:, i + k]``. labels (B, T) -> list of 0-d tensors (sums over valid targets).

    ``shift``: the model's ``mtp_shift`` hook for full-length logits (B, T, V) (default
    ``shift_left``). ``loss_sum(logits (B, T', V'), target (B, T'))``: the summed token loss
    (default cross-entropy; tensor parallel passes its vocab-parallel one)."""
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
    """Valid targets per depth k = 1..depth in a (B, T) label batch (``shift``: the model's
    ``mtp_shift`` hook; a collective under context parallel)."""
    if shift is None:
        return [int((labels[:, k:] != ignore_index).sum()) for k in range(1, depth + 1)]
    return [int((shift(labels, k, ignore_index) != ignore_index).sum()) for k in range(1, depth + 1)]
