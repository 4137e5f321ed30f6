"""A Llama-3-style decoder (Llama 3, 2024; Touvron 2023): pre-norm RMSNorm (Zhang & Sennrich 2019),
causal GQA (Ainslie 2023) with RoPE (Su 2021), SwiGLU (Shazeer 2020).

Single-device, parallel-agnostic: ``layers`` is a ModuleDict keyed "0".."L-1" (a pp stage deletes
blocks and keeps names); ``tok_embeddings`` / ``norm`` / ``output`` may be None (a stage then takes
or returns (B, T, C) hidden states); head counts come from weight shapes at forward time (tp);
``Attention.core`` is cp's hook. Module names are the contract with ``ndtrain.hf.llama`` and the
name-based parallel plans."""
from __future__ import annotations

import torch
from torch import nn

from ndtrain.config import ModelConfig
from ndtrain.model.attention import KVCacheLike
from ndtrain.model.block import TransformerBlock
from ndtrain.model.documents import document_positions
from ndtrain.model.init import init_weights
from ndtrain.model.mtp import MTPModule, mtp_forward, mtp_token_ids
from ndtrain.model.norm import RMSNorm
from ndtrain.model.rope import rope_tables


class Transformer(nn.Module):
    """Decoder-only transformer; build with ``build_model`` (meta, then ``init_weights``).

    ``tok_embeddings`` (V, C) | None, ``layers``, ``norm`` | None, ``output`` C -> V | None (the
    embedding's weight when tied), non-persistent fp32 ``rope_cos`` / ``rope_sin`` (max_seq_len, D/2),
    garbage after ``to_empty`` until ``init_rope``."""

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
        """Make ``output.weight`` the embedding's Parameter if tied; again after ``to_empty``, which
        unties."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self) -> None:
        """(Re)build the RoPE tables in float32 on the buffers' current device."""
        cos, sin = rope_tables(self.cfg)  # (S, D/2) each, CPU fp32
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)

    def init_weights(self, seed: int = 0, hidden_std_factor: float = 1.0) -> None:
        """Deterministic init, independent of device, dtype and which layers exist (``init.py``)."""

        init_weights(self, seed, hidden_std_factor)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache: KVCacheLike | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64, or (B, T, C) hidden states without ``tok_embeddings`` -> logits (B, T, V), or
        hidden states (B, T, C) without ``output``.

        ``positions``: (T,) or (B, T) int64 (default ``arange(T)`` after ``kv_cache.length``); ``kv_cache``:
        appended and advanced by T. ``documents``: (B, T) int packed document ids (no cache): attention
        and state stay inside a document, positions default to ``document_positions``. A training forward with MTP also sets ``self.mtp_logits``
        (depth k: (B, T-k, V)). Raises ValueError if a cached forward would pass ``max_seq_len``."""
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()  # a pipeline stage's
        h = self.tok_embeddings(tokens) if embed else tokens  # (B, T, C); head stage: MTP's embedding copy
        t = h.shape[1]
        if documents is not None and kv_cache is not None:
            raise ValueError("documents (packed sequences) are for training and evaluation, not a KV-cached forward")
        if positions is None and documents is not None:
            positions = document_positions(documents)  # (B, T): the whole row is here
        if positions is None:
            start = kv_cache.length if kv_cache is not None else 0
            if start + t > self.cfg.max_seq_len:
                raise ValueError(f"positions up to {start + t} exceed max_seq_len ({self.cfg.max_seq_len})")
            positions = torch.arange(start, start + t, device=h.device)  # (T,)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (T, D/2) or (B, T, D/2)
        for layer in self.layers.values():
            h = layer(h, cos, sin, kv_cache) if documents is None else layer(h, cos, sin, kv_cache, documents)
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
                seed: int = 0, hidden_std_factor: float = 1.0) -> nn.Module:
    """A ``Transformer`` built on meta, materialised on ``device`` in ``dtype`` (RoPE tables float32),
    initialised (``init.init_weights``), in train mode."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype=dtype)  # free on meta
    model.to_empty(device=device)  # unties tied weights; init_weights re-ties them
    model.init_weights(seed, hidden_std_factor)
    return model
