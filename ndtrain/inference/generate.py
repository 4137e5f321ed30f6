"""Autoregressive sampling with a key/value cache (the standard decoder inference scheme; see e.g.
Pope 2022, "Efficiently Scaling Transformer Inference").

``KVCache`` preallocates, per layer, keys and values for ``max_seq_len`` positions and tracks how
many are filled; ``Transformer.forward(tokens, kv_cache=cache)`` appends the new tokens' keys and
values, attends causally over the cached prefix plus the new tokens, uses RoPE positions
``length .. length + T - 1``, and advances the cache. ``generate`` prefills the prompt in one forward
and then decodes one token per forward.
"""
from __future__ import annotations

from collections.abc import Iterator

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
        # fixed-size states of recurrent mixers (and DSA indexer keys) by layer id, written by the
        # mixers themselves (ndtrain.model.mixers); a state is valid for the first ``length`` tokens
        self.states: dict[str, dict[str, torch.Tensor]] = {}

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
        self.states.clear()


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
    """Pick next tokens from logits (B, V): argmax when ``temperature == 0``, else sample from
    softmax(logits / temperature) restricted to the ``top_k`` largest (0 = no restriction), then to
    the nucleus: the fewest most likely tokens whose probabilities sum to >= ``top_p`` (Holtzman
    2020, "The Curious Case of Neural Text Degeneration"; 1.0 = no restriction; the most likely
    token is always kept).

    Returns (B,) int64 on the logits' device. Raises ValueError for a negative temperature / top_k
    or a top_p outside (0, 1].
    """
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature ({temperature}) and top_k ({top_k}) must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p ({top_p}) must be in (0, 1]")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # (B, V)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if top_p < 1:
        probs = _nucleus(probs, top_p)
    if generator is not None:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)  # (B,)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (B, V) with everything outside the top-p nucleus zeroed (not renormalised:
    ``multinomial`` takes weights)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # (B, V)
    # a token is dropped when the tokens ranked above it already reach top_p
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # (B, V)
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def stream_tokens(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, generator: torch.Generator | None = None, use_cache: bool = True,
                  top_p: float = 1.0, stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids after ``prompt``, one per decode step, as soon as
    each is chosen (what a console streams). A token in ``stop_ids`` is yielded, then decoding stops.
    Arguments and errors as ``generate``; the model is in eval mode while the iterator runs and
    its train / eval mode is restored when it ends or is closed."""
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"prompt must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
    inner = getattr(model, "module", model)  # a DDP-style wrapper keeps the Transformer in .module
    total = prompt.numel() + max_new_tokens
    if total > inner.cfg.max_seq_len:
        raise ValueError(f"prompt ({prompt.numel()}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len ({inner.cfg.max_seq_len})")
    return _stream(model, inner, prompt, max_new_tokens, (temperature, top_k, top_p), generator,
                   use_cache, set(stop_ids))


def _stream(model, inner, prompt, max_new_tokens, sampling, generator, use_cache, stop):
    was_training = model.training
    model.eval()
    device = inner.rope_cos.device
    seq = prompt.to(device).view(1, -1)  # (1, T0)
    cache = KVCache(1, prompt.numel() + max_new_tokens) if use_cache else None
    step_in = seq
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(step_in if use_cache else seq, kv_cache=cache)  # (1, T, V)
                nxt = sample_next(logits[:, -1], sampling[0], sampling[1], generator, sampling[2])  # (1,)
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)  # (1, T + 1)
                step_in = nxt.view(1, 1)
                yield int(nxt)
                if int(nxt) in stop:
                    return
    finally:
        model.train(was_training)


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, generator: torch.Generator | None = None, use_cache: bool = True,
             top_p: float = 1.0, stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """Extend ``prompt`` by ``max_new_tokens`` tokens (fewer when one of ``stop_ids`` comes first).

    Args:
        model: a full ``Transformer`` (embedding and output head present), or a wrapper holding
            it as ``.module``.
        prompt: (T0,) int64 token ids, T0 >= 1.
        temperature, top_k, top_p: see ``sample_next`` (greedy by default).
        generator: optional ``torch.Generator`` for reproducible sampling.
        use_cache: False recomputes the full sequence every step (the reference the cache is
            tested against).
        stop_ids: token ids that end generation (kept in the output), e.g. the EOS id.

    Returns: (T0 + n_new,) int64 on the prompt's device: the prompt, then the new tokens.
    Raises ValueError if the prompt is not 1-D and non-empty or T0 + max_new_tokens exceeds
    ``model.cfg.max_seq_len``. The model's train / eval mode is restored afterwards.
    """
    new = list(stream_tokens(model, prompt, max_new_tokens, temperature, top_k, generator, use_cache,
                             top_p, stop_ids))
    return torch.cat([prompt.view(-1), torch.tensor(new, dtype=torch.long, device=prompt.device)])


class TextStream:
    """Incremental detokenisation for streaming: ``push(token_id)`` returns the text that became
    final with this token. A byte-level token may end inside a multi-byte character, whose
    incomplete decode ends in U+FFFD; such a tail is held back until a later token completes it
    (``flush`` returns whatever is left at the end)."""

    def __init__(self, decode, prefix_ids: list[int] | None = None):
        self.decode, self.ids = decode, list(prefix_ids or [])
        self.emitted = len(decode(self.ids)) if self.ids else 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        out, self.emitted = text[self.emitted:], len(text)
        return out

    def flush(self) -> str:
        text = self.decode(self.ids)
        out, self.emitted = text[self.emitted:], len(text)
        return out
