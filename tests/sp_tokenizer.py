"""A tiny SentencePiece-style ``tokenizer.json`` built with the ``tokenizers`` library, shared by the
tests: a Unigram model with byte fallback (``<0x00>``..``<0xFF>``), the Metaspace pre-tokenizer
(``▁`` for spaces, one prepended to every text) and the Llama-2 decoder chain (``▁`` -> space, byte
pieces -> bytes, fuse, strip the prepended space). Optionally a Llama-3-style post-processor that
adds ``<|begin_of_text|>`` in front of every encoding."""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>"]
PIECES = ["▁the", "▁cat", "▁caf", "▁sat", "▁on", "▁", "t", "h", "e", "c", "a", "f", "s", "o", "n"]


def build_sp_tokenizer(folder: Path, bos_post_processor: bool = False) -> Path:
    """Write ``folder/tokenizer.json``; returns its path. Ids: specials 0..2, bytes 3..258, pieces
    259.. (and ``<|begin_of_text|>`` last when ``bos_post_processor``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = [(s, 0.0) for s in SPECIALS] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [(p, -float(i + 1)) for i, p in enumerate(PIECES)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    if bos_post_processor:
        tok.add_special_tokens([AddedToken("<|begin_of_text|>", special=True)])
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
