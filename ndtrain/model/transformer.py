"""A Llama-3-style decoder (Llama 3, 2024; Touvron 2023): pre-norm RMSNorm (Zhang & Sennrich 2019),
causal GQA attention (Ainslie 2023) with RoPE (Su 2021), SwiGLU feed-forward (Shazeer 2020).

Single-device and parallel-agnostic, but composable:

* ``layers`` is an ``nn.ModuleDict`` keyed "0".."L-1"; a pipeline stage deletes the blocks it does
  not own and keeps the others' names (so checkpoints and per-parameter init seeds line up).
* ``tok_embeddings``, ``norm`` and ``output`` may be set to None: a stage without an embedding takes
  hidden states (B, T, C) instead of tokens, and a stage without an output returns hidden states.
* Head counts are inferred from weight shapes at forward time, so tensor parallel shards heads
  without changing this code; ``Attention.core`` is the hook for context parallel.

Module names (``attention.wq`` ..., ``feed_forward.w1`` ...) are the contract with ``ndtrain.hf.llama``
and the parallelisms that shard by name.
"""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.attention import KVCacheLike
from ndtrain.model.block import TransformerBlock
from ndtrain.model.init import init_weights
from ndtrain.model.mtp import MTPModule, mtp_forward, mtp_token_ids
from ndtrain.model.norm import RMSNorm
from ndtrain.model.rope import rope_tables


class Transformer(nn.Module):
    """Decoder-only transformer.

    Attributes: ``tok_embeddings`` (V, C) | None, ``layers`` ModuleDict of ``TransformerBlock``,
    ``norm`` RMSNorm | None, ``output`` Linear C -> V without bias | None (its weight *is* the
    embedding's when ``cfg.tie_embeddings``), non-persistent fp32 buffers ``rope_cos`` / ``rope_sin``
    (max_seq_len, D/2) built by ``init_rope`` (called by ``init_weights``; after meta construction
    and ``to_empty`` they are garbage until then).

    Construct through ``ndtrain.model.build_model`` (meta device, then ``init_weights``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, str(i)) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # DeepSeek-V3 multi-token prediction modules (ndtrain.model.mtp); None when mtp_depth == 0
        self.mtp: nn.ModuleDict | None = (nn.ModuleDict({str(k): MTPModule(cfg, k) for k in range(cfg.mtp_depth)})
                                          if cfg.mtp_depth else None)
        self.mtp_logits: list[torch.Tensor] = []  # set by a training forward when mtp is present
        self.tie_weights()
        half = cfg.rope_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, half), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_rope()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding's Parameter when ``cfg.tie_embeddings`` (and both
        exist). Needed again after ``to_empty``, which materialises each module's parameters
        separately and so unties them."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self) -> None:
        """(Re)build the RoPE tables in float32 on the buffers' current device."""
        cos, sin = rope_tables(self.cfg)  # (S, D/2) each, CPU fp32
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init, independent of device, dtype and which layers exist; see ``init.py``."""

        init_weights(self, seed)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache: KVCacheLike | None = None) -> torch.Tensor:
        """Run the stage.

        Args:
            tokens: (B, T) int64 token ids, or (B, T, C) hidden states when ``tok_embeddings`` is None.
            positions: (T,) or (B, T) int64 RoPE positions (need not be contiguous, e.g. for context
                parallel); default ``arange(T)``, offset by ``kv_cache.length`` when a cache is given.
            kv_cache: optional cache (``ndtrain.inference.generate.KVCache``); keys / values of these tokens are
                appended and the cache is advanced by T.

        Returns: logits (B, T, V) in the parameter / autocast dtype, or hidden states (B, T, C) when
        ``output`` is None. A training forward (``self.training``, grad enabled, no cache) of a model
        with MTP modules also sets ``self.mtp_logits`` (depth k: (B, T-k, V)); MoE layers record
        their auxiliary losses (``ndtrain.model.moe_balance.pop_aux_loss``).
        Raises ValueError if a cached forward would run past ``max_seq_len``.
        """
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()  # a pipeline stage's
        h = self.tok_embeddings(tokens) if embed else tokens  # (B, T, C); head stage: MTP's embedding copy
        t = h.shape[1]
        if positions is None:
            start = kv_cache.length if kv_cache is not None else 0
            if start + t > self.cfg.max_seq_len:
                raise ValueError(f"positions up to {start + t} exceed max_seq_len ({self.cfg.max_seq_len})")
            positions = torch.arange(start, start + t, device=h.device)  # (T,)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (T, D/2) or (B, T, D/2)
        for layer in self.layers.values():
            h = layer(h, cos, sin, kv_cache)  # (B, T, C)
        if kv_cache is not None:
            kv_cache.advance(t)
        self.mtp_logits = []
        ids = mtp_token_ids(self, tokens)  # the token ids (a pipeline's head stage: fed by the runtime)
        if (self.mtp is not None and kv_cache is None and self.training and torch.is_grad_enabled()
                and ids is not None and self.tok_embeddings is not None and self.output is not None):
            self.mtp_logits = mtp_forward(self, ids, h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # (B, T, V) or (B, T, C)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> nn.Module:
    """Construct a ``Transformer`` on the meta device, materialise on ``device`` in ``dtype``, init.

    Returns the model in train mode. Parameters are ``dtype``; the RoPE tables stay float32.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype=dtype)  # free on meta
    model.to_empty(device=device)  # unties tied weights; init_weights re-ties them
    model.init_weights(seed)
    return model
