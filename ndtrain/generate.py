"""Autoregressive sampling with a key/value cache (the standard decoder inference scheme; see e.g.
Pope 2022, "Efficiently Scaling Transformer Inference").

``KVCache`` preallocates, per layer, keys and values for ``max_seq_len`` positions and tracks how
many are filled; ``Transformer.forward(tokens, kv_cache=cache)`` appends the new tokens' keys and
values, attends causally over the cached prefix plus the new tokens, uses RoPE positions
``length .. length + T - 1``, and advances the cache. ``generate`` prefills the prompt in one forward
and then decodes one token per forward.
"""
from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Per-layer key / value buffers of shape (B, G, max_seq_len, D).

    Buffers are allocated on a layer's first ``update`` with that layer's kv-head count, dtype and
    device (so a tensor-parallel shard or an autocast dtype is picked up without configuration).

    Args:
        batch_size: B; max_seq_len: positions the cache can hold.
    """

    def __init__(self, batch_size: int, max_seq_len: int):
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.length = 0  # tokens cached so far (all layers)
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def update(self, layer_id: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k (B, G, T, D), v (B, G, T, D_v) at positions [length, length + T) of ``layer_id``.

        Returns views (B, G, length + T, D) of everything cached for the layer.
        Raises ValueError if the batch size differs or the cache would overflow.
        """
        b, g, t, d = k.shape
        if b != self.batch_size:
            raise ValueError(f"KVCache holds batch {self.batch_size}, got {b}")
        end = self.length + t
        if end > self.max_seq_len:
            raise ValueError(f"KVCache overflow: {end} tokens > max_seq_len {self.max_seq_len}")
        if layer_id not in self.k:
            shape = (b, g, self.max_seq_len, d)  # (B, G, S, D)
            self.k[layer_id] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            # v may be narrower than k (MLA caches its latent as k and its RoPE key as v)
            self.v[layer_id] = torch.zeros(shape[:-1] + v.shape[-1:], dtype=v.dtype, device=v.device)
        ck, cv = self.k[layer_id], self.v[layer_id]
        ck[:, :, self.length:end] = k
        cv[:, :, self.length:end] = v
        return ck[:, :, :end], cv[:, :, :end]

    def advance(self, n_tokens: int) -> None:
        """Mark ``n_tokens`` more positions as filled (called once per model forward)."""
        self.length += n_tokens

    def reset(self) -> None:
        self.length = 0


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick next tokens from logits (B, V): argmax when ``temperature == 0``, else sample from
    softmax(logits / temperature) restricted to the ``top_k`` largest (0 = no restriction).

    Returns (B,) int64 on the logits' device. Raises ValueError for a negative temperature / top_k.
    """
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature ({temperature}) and top_k ({top_k}) must be >= 0")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # (B, V)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if generator is not None:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)  # (B,)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
    """Extend ``prompt`` by ``max_new_tokens`` tokens.

    Args:
        model: a full ``Transformer`` (embedding and output head present), or a wrapper holding
            it as ``.module``.
        prompt: (T0,) int64 token ids, T0 >= 1.
        temperature, top_k: see ``sample_next`` (greedy by default).
        generator: optional ``torch.Generator`` for reproducible sampling.
        use_cache: False recomputes the full sequence every step (the reference the cache is
            tested against).

    Returns: (T0 + max_new_tokens,) int64 on the prompt's device: the prompt, then the new tokens.
    Raises ValueError if the prompt is not 1-D and non-empty or T0 + max_new_tokens exceeds
    ``model.cfg.max_seq_len``. The model's train / eval mode is restored afterwards.
    """
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"prompt must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
    inner = getattr(model, "module", model)  # a DDP-style wrapper keeps the Transformer in .module
    total = prompt.numel() + max_new_tokens
    if total > inner.cfg.max_seq_len:
        raise ValueError(f"prompt ({prompt.numel()}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len ({inner.cfg.max_seq_len})")
    was_training = model.training
    model.eval()
    device = inner.rope_cos.device
    seq = prompt.to(device).view(1, -1)  # (1, T0)
    cache = KVCache(1, total) if use_cache else None
    step_in = seq
    try:
        for _ in range(max_new_tokens):
            logits = model(step_in if use_cache else seq, kv_cache=cache)  # (1, T, V)
            nxt = sample_next(logits[:, -1], temperature, top_k, generator)  # (1,)
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)  # (1, T + 1)
            step_in = nxt.view(1, 1)
    finally:
        model.train(was_training)
    return seq.view(-1).to(prompt.device)
