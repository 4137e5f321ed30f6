"""Held-out evaluation of a trained model: loss, perplexity and bits per byte (``ndtrain eval``).

Windows are cut as in training (``TokenData.get``): sequence i of a token stream is tokens
``[i*T, i*T + T + 1)``, inputs its first T, labels its last T. Batch b holds sequences
``(b*G + j) mod n`` for j < G (G = ``training.global_batch_size``, n = sequences in the stream), the
order ``train._val_loss`` uses, so ``--batches training.eval_batches`` on the run's validation split
reproduces the ``val_loss`` the run logged. Without a batch count every sequence is evaluated once.

Metrics, over all evaluated label tokens y_1..y_N (cross-entropies in nats):

    loss           = sum_i CE_i / N
    perplexity     = exp(loss)
    bits_per_byte  = sum_i CE_i / (ln 2 * sum_i bytes(y_i))

``bytes(y)`` is the number of UTF-8 bytes token y stands for: 1 per byte for the ``"bytes"``
tokenizer, the length of the token's byte-level spelling for a byte-level BPE (exact: GPT-2's
byte alphabet spells one byte per character), 0 for special tokens (EOS). For other tokenizers it
is the UTF-8 length of the token decoded alone, which miscounts tokens holding part of a character.
Bits per byte compares models with different tokenizers (Gao 2020, "The Pile", section 4.2).
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, byte_level_alphabet


def token_byte_lengths(tok: Tokenizer, vocab_size: int) -> np.ndarray:
    """int64 (vocab_size,): UTF-8 bytes each token id stands for (see the module docstring); ids
    the tokenizer does not use (the model's padding rows) count 0."""
    out = np.zeros(vocab_size, dtype=np.int64)
    if isinstance(tok, ByteTokenizer):
        out[:256] = 1
        return out
    if not isinstance(tok, HFTokenizer):
        raise TypeError(f"no byte lengths for tokenizer type {type(tok).__name__}")
    inner = tok._tok
    special = {t.content for t in inner.get_added_tokens_decoder().values() if t.special}
    spelled = (json.loads(inner.to_str()).get("decoder") or {}).get("type") == "ByteLevel"
    alphabet = set(byte_level_alphabet().values())
    for token, tid in inner.get_vocab(with_added_tokens=True).items():
        if tid >= vocab_size or token in special:
            continue
        if spelled and all(ch in alphabet for ch in token):
            out[tid] = len(token)
        else:
            out[tid] = len(tok.decode([tid]).encode("utf-8"))
    return out


def stream_tokens_of(source: str, data_cfg, tok: Tokenizer, max_tokens: int = 0) -> np.ndarray:
    """The token stream of corpus ``source`` (a path / glob / "stdlib", as ``data.source``): each
    document encoded by ``tok`` and followed by EOS, ``data_cfg``'s text field; reading stops once
    ``max_tokens`` (> 0) are collected. Raises ValueError as ``iter_documents``."""
    from ndtrain.data.corpus import iter_documents

    cfg = dataclasses.replace(data_cfg, source=source, max_corpus_bytes=0)
    parts, n = [], 0
    for doc in iter_documents(cfg):
        ids = tok.encode_docs([doc])
        parts.append(ids)
        n += len(ids)
        if max_tokens and n >= max_tokens:
            break
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@torch.no_grad()
def evaluate(model: nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int,
             byte_lengths: np.ndarray, batches: int | None = None) -> dict:
    """Metrics of ``model`` (a single-process ``Transformer``) on the token stream ``tokens`` (n,).

    Args:
        seq_len: T; batch_size: G sequences per forward; batches: how many (None: every sequence
            once; a count wraps around the stream as training's validation does).
        byte_lengths: (V,) bytes per token id (``token_byte_lengths``).
    Returns ``{"loss", "perplexity", "bits_per_byte", "tokens", "bytes", "sequences"}``.
    Raises ValueError when the stream holds less than one sequence of T + 1 tokens.
    """
    n_seq = max(0, (len(tokens) - 1) // seq_len)
    if n_seq < 1:
        raise ValueError(f"the evaluation text gives {len(tokens)} tokens, fewer than one sequence of "
                         f"seq_len + 1 ({seq_len + 1})")
    order = ([(b * batch_size + j) % n_seq for b in range(batches) for j in range(batch_size)]
             if batches is not None else list(range(n_seq)))
    device = model.rope_cos.device
    lengths = torch.from_numpy(byte_lengths)
    ce_sum, n_tok, n_bytes = 0.0, 0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(order), batch_size):
        idx = np.asarray(order[start:start + batch_size], dtype=np.int64)
        windows = torch.from_numpy(tokens[idx[:, None] * seq_len + np.arange(seq_len + 1)].astype(np.int64))
        inputs, labels = windows[:, :-1].to(device), windows[:, 1:]  # (B, T) each
        logits = model(inputs).float()  # (B, T, V)
        ce_sum += F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten(), reduction="sum").item()
        n_tok += labels.numel()
        n_bytes += int(lengths[labels].sum())
    model.train(was_training)
    loss = ce_sum / n_tok
    return {"loss": loss, "perplexity": math.exp(loss),
            "bits_per_byte": ce_sum / (math.log(2) * n_bytes) if n_bytes else float("nan"),
            "tokens": n_tok, "bytes": n_bytes, "sequences": len(order)}
