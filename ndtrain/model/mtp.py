"""Multi-token prediction (MTP; DeepSeek-V3, 2024, section 2.2; Gloeckle et al. 2024 for the idea).

D sequential modules extend the main model's prediction depth. Module k (1-based) combines the
previous depth's representation of position i with the embedding of token t_{i+k}:

    h'_i = W_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]          (2C -> C)
    h^k  = TransformerBlock_k(h'), over the T-k positions where t_{i+k} exists
    logits^k_i = OutputHead(RMSNorm_k(h^k_i))    predicts t_{i+k+1}

``h^0`` is the main model's last hidden state before its final norm. The embedding and the output
head are the main model's (shared), so gradients of the MTP loss reach them. With the main
model's labels ``labels[i] = t_{i+1}``, depth k's target at position i is ``labels[i + k]``.

Loss (DeepSeek-V3 eq. 24-25): ``lambda / D * sum_k L^k`` with ``L^k`` the token-weighted mean
cross-entropy of depth k over the global batch (``ndtrain.train_extras`` computes it). At inference
the modules are skipped (they could serve speculative decoding; not implemented).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.block import TransformerBlock
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


def mtp_forward(model, tokens: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> list[torch.Tensor]:
    """Run ``model.mtp`` after the main trunk.

    Args: tokens (B, T) input ids; h (B, T, C) last hidden before the final norm; cos / sin (T, D/2)
    or (B, T, D/2) at the input positions.
    Returns: D logits tensors, depth k (1-based) of shape (B, T-k, V).
    """
    out = []
    t = tokens.shape[1]
    for k, module in enumerate(model.mtp.values(), start=1):
        if t - k <= 0:
            break
        e = model.tok_embeddings(tokens[:, k:])  # (B, T-k, C): Emb(t_{i+k})
        h = module(h[:, :t - k], e, cos[..., :t - k, :], sin[..., :t - k, :])  # (B, T-k, C)
        out.append(model.output(module.norm(h)))  # (B, T-k, V)
    return out


def mtp_loss_sums(mtp_logits: list[torch.Tensor], labels: torch.Tensor,
                  ignore_index: int = -100) -> list[torch.Tensor]:
    """Summed cross-entropy of each depth: depth k (1-based) scores ``logits^k[:, i]`` against
    ``labels[:, i + k]``. labels (B, T) -> list of 0-d tensors (sums over valid targets)."""
    sums = []
    for k, logits in enumerate(mtp_logits, start=1):
        target = labels[:, k:]  # (B, T-k)
        sums.append(F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                                    target.flatten(), ignore_index=ignore_index, reduction="sum"))
    return sums


def mtp_valid_counts(labels: torch.Tensor, depth: int, ignore_index: int = -100) -> list[int]:
    """Valid targets per depth k = 1..depth in a (B, T) label batch."""
    return [int((labels[:, k:] != ignore_index).sum()) for k in range(1, depth + 1)]
