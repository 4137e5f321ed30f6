"""Held-out evaluation of a trained model: loss, perplexity and bits per byte (``ndtrain eval``).

Windows are cut as in training (``TokenData.get``): sequence i of a token stream is tokens
``[i*T, i*T + T + 1)``, inputs its first T, labels its last T. Batch b holds sequences
``(b*G + j) mod n`` for j < G (G = ``training.global_batch_size``, n = sequences in the stream), the
order ``train._val_loss`` uses, so ``--batches training.eval_batches`` on the run's validation split
reproduces the ``val_loss`` the run logged. Without a batch count every sequence is evaluated once.

Metrics, over all evaluated label positions y_1..y_N (cross-entropies in nats):

    loss           = sum_i CE_i / N
    perplexity     = exp(loss)
    bits_per_byte  = sum_i CE_i / (ln 2 * sum_i bytes(y_i))

``bytes(y_i)`` is what label position i adds to the UTF-8 text of its document, decoded
(``stream_byte_counts``): 1 per byte for the ``"bytes"`` tokenizer, the length of the token's
byte-level spelling for a byte-level BPE (exact and context-free: GPT-2's byte alphabet spells one
byte per character), 0 for special tokens (EOS, BOS). Any other tokenizer (SentencePiece-style:
``▁`` for spaces, the prefix space a document's first piece carries, byte-fallback pieces
``<0xE2>``) is decoded document by document in order (``tokenizers`` ``DecodeStream``): each
position counts the bytes of the text that became final with it, so a multi-byte character spelled by byte-fallback
pieces counts once, on the piece completing it, and the bytes of every evaluated span sum to its
decoded text. Bits per byte compares models with different tokenizers (Gao 2020, "The Pile",
section 4.2).
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


def token_byte_lengths(tok: Tokenizer, vocab_size: int) -> np.ndarray | None:
    """int64 (vocab_size,): UTF-8 bytes each token id stands for wherever it stands, or None when
    that depends on the context (a tokenizer that is neither ``"bytes"`` nor a byte-level BPE
    spelling every token in GPT-2's alphabet). Special tokens and unused ids count 0."""
    out = np.zeros(vocab_size, dtype=np.int64)
    if isinstance(tok, ByteTokenizer):
        out[:256] = 1
        return out
    if not isinstance(tok, HFTokenizer):
        raise TypeError(f"no byte lengths for tokenizer type {type(tok).__name__}")
    inner = tok._tok
    if (json.loads(inner.to_str()).get("decoder") or {}).get("type") != "ByteLevel":
        return None
    special = _special_ids(tok)
    alphabet = set(byte_level_alphabet().values())
    for token, tid in inner.get_vocab(with_added_tokens=True).items():
        if tid >= vocab_size or tid in special:
            continue
        if not all(ch in alphabet for ch in token):
            return None  # an added plain-text token: decoded in context instead
        out[tid] = len(token)
    return out


def stream_byte_counts(tok: Tokenizer, tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 (n,): the UTF-8 bytes each position of the token stream ``tokens`` (n,) adds to the
    decoded text of its document (module docstring); special tokens (EOS) count 0 and start a new
    document. Exact: the counts of a document sum to the UTF-8 size of its decoded text."""
    table = token_byte_lengths(tok, vocab_size)
    if table is not None:
        return table[np.asarray(tokens, dtype=np.int64)]
    from tokenizers.decoders import DecodeStream

    special, inner = _special_ids(tok), tok._tok
    out = np.zeros(len(tokens), dtype=np.int64)
    stream = None
    for i, tid in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        if tid in special or tid >= tok.vocab_size:
            stream = None  # a document boundary: the next piece is decoded as a document start
            continue
        stream = stream or DecodeStream(skip_special_tokens=False)
        chunk = stream.step(inner, tid)
        out[i] = len(chunk.encode("utf-8")) if chunk else 0
    return out


def _special_ids(tok: HFTokenizer) -> set[int]:
    marks = {tok.eos_id} | ({tok.bos_id} if tok.bos_id is not None else set())
    return {tid for tid, t in tok._tok.get_added_tokens_decoder().items() if t.special} | marks


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
             byte_counts: np.ndarray, batches: int | None = None) -> dict:
    """Metrics of ``model`` (a single-process ``Transformer``) on the token stream ``tokens`` (n,).

    Args:
        seq_len: T; batch_size: G sequences per forward; batches: how many (None: every sequence
            once; a count wraps around the stream as training's validation does).
        byte_counts: (n,) bytes each stream position stands for (``stream_byte_counts``).
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
    ce_sum, n_tok, n_bytes = 0.0, 0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(order), batch_size):
        idx = np.asarray(order[start:start + batch_size], dtype=np.int64)
        pos = idx[:, None] * seq_len + np.arange(seq_len + 1)  # (B, T + 1) stream positions
        windows = torch.from_numpy(tokens[pos].astype(np.int64))
        inputs, labels = windows[:, :-1].to(device), windows[:, 1:]  # (B, T) each
        logits = model(inputs).float()  # (B, T, V)
        ce_sum += F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten(), reduction="sum").item()
        n_tok += labels.numel()
        n_bytes += int(byte_counts[pos[:, 1:]].sum())  # the labels' bytes
    model.train(was_training)
    loss = ce_sum / n_tok
    return {"loss": loss, "perplexity": math.exp(loss),
            "bits_per_byte": ce_sum / (math.log(2) * n_bytes) if n_bytes else float("nan"),
            "tokens": n_tok, "bytes": n_bytes, "sequences": len(order)}
