"""Tokenizers: byte-level BPE trained on the corpus (cached), raw UTF-8 bytes, or a tokenizer.json.

``DataConfig.tokenizer`` selects one:

- ``"bpe"``: byte-level BPE (GPT-2 style pre-tokenization, Sennrich 2016 merges) trained with the
  ``tokenizers`` library on ``iter_documents(cfg)``, vocabulary = the model's ``vocab_size``
  (fewer if the corpus runs out of merges). The special token ``<|endoftext|>`` is the EOS.
  Cached at ``<cache>/tokenizers/bpe-<fingerprint>-v<vocab_size>/tokenizer.json``.
- ``"bytes"``: ids 0..255 are UTF-8 bytes, 256 is EOS; vocab 257.
- a path to a ``tokenizer.json`` (e.g. a Hugging Face model folder's), loaded with
  ``tokenizers.Tokenizer.from_file``. EOS: ``eos_token`` of a ``tokenizer_config.json`` next to the
  file if present, else the first known EOS token in the vocabulary (``_KNOWN_EOS``), else
  ``DataConfig.eos_id``; with none of these a ValueError asks for ``data.eos_id``.

BOS policy: ndtrain follows the tokenizer file. When its post-processor puts a token in front of
every encoding (Llama 3's ``<|begin_of_text|>``: the family is pretrained with it), that token is
the BOS and every document in training, every ``generate`` prompt, every evaluated document and
the exported Hugging Face tokenizer start with it; ``bos_id`` names it. Otherwise (``"bytes"``,
``"bpe"``, a file without such a post-processor) nothing is prepended and ``bos_id`` is None. The
EOS follows every document either way; any suffix the post-processor would add is not used.

The cache root is ``DataConfig.cache_dir``, else ``$NDTRAIN_CACHE``, else ``~/.cache/ndtrain``.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ndtrain.config import DataConfig
from ndtrain.data.corpus import iter_documents, source_fingerprint

EOS_TOKEN = "<|endoftext|>"
_KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


def cache_root(cfg: DataConfig) -> Path:
    """``cfg.cache_dir``, else ``$NDTRAIN_CACHE``, else ``~/.cache/ndtrain`` (not created here)."""
    root = cfg.cache_dir or os.environ.get("NDTRAIN_CACHE") or "~/.cache/ndtrain"
    return Path(root).expanduser()


class Tokenizer:
    """Common interface. ``spec`` is what ``open_tokenizer`` needs to load it back."""

    spec: str
    vocab_size: int  # number of ids, including special tokens
    eos_id: int  # appended after every document
    bos_id: int | None = None  # put in front of every document / prompt (module docstring), or None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} must implement encode (abstract interface)")

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement decode (abstract interface)")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_docs(self, texts: list[str]) -> np.ndarray:
        """Token ids of ``texts``, each followed by ``eos_id``, concatenated: int64 (n_tokens,)."""
        eos = np.array([self.eos_id], dtype=np.int64)
        parts = []
        for ids in self.encode_batch(texts):
            parts += [np.asarray(ids, dtype=np.int64), eos]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, EOS = 256 (vocab 257). Decoding drops ids >= 256."""

    def __init__(self):
        self.spec, self.vocab_size, self.eos_id = "bytes", 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_docs(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, np.int64)
        encoded = [t.encode("utf-8") for t in texts]
        # join with a placeholder byte, then overwrite the placeholders (one after each document)
        out = np.frombuffer(b"\0".join(encoded) + b"\0", dtype=np.uint8).astype(np.int64)
        lens = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        out[np.cumsum(lens + 1) - 1] = self.eos_id
        return out


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json`` (BPE-trained ones included)."""

    def __init__(self, path: str | Path, eos_id: int = -1):
        from tokenizers import Tokenizer as _Tok

        path = Path(path).expanduser()
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"cannot load tokenizer file {path}: {e}") from e
        self.spec = str(path.resolve())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(path, eos_id)
        self.bos_id = self._find_bos()

    def _find_bos(self) -> int | None:
        """The one id the post-processor puts in front of an encoding (None if it adds none)."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        k = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        if k == 0:
            return None
        if k > 1:
            raise ValueError(f"tokenizer {self.spec}: its post-processor prepends {k} tokens "
                             f"({full[:k]}); ndtrain supports one BOS token")
        return full[0]

    def _find_eos(self, path: Path, fallback: int) -> int:
        names = []
        tc = path.parent / "tokenizer_config.json"
        if tc.is_file():
            try:
                eos = json.loads(tc.read_text()).get("eos_token")
            except (OSError, ValueError):
                eos = None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        for name in names + list(_KNOWN_EOS):
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        if fallback >= 0:
            if fallback >= self.vocab_size:
                raise ValueError(f"data.eos_id ({fallback}) is outside the vocabulary of {path} "
                                 f"({self.vocab_size} ids)")
            return fallback
        raise ValueError(f"tokenizer {path} has no recognisable EOS token (tried {list(_KNOWN_EOS)}); "
                         f"set data.eos_id to the id that separates documents")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, led by ``bos_id`` when the tokenizer has one (module docstring)."""
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        lead = [] if self.bos_id is None else [self.bos_id]
        return [lead + e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))


def _check_fits(tok: Tokenizer, vocab_size: int | None) -> Tokenizer:
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.spec!r} has {tok.vocab_size} ids, more than the model's "
                         f"vocab_size ({vocab_size})")
    return tok


def open_tokenizer(spec: str, vocab_size: int | None = None, eos_id: int = -1) -> Tokenizer:
    """Open ``"bytes"`` or a ``tokenizer.json`` path (no training). ``eos_id``: fallback EOS id.

    Raises:
        ValueError: unloadable file, no EOS found, or more ids than ``vocab_size`` (names both).
    """
    if spec == "bytes":
        return _check_fits(ByteTokenizer(), vocab_size)
    if spec == "bpe":
        raise ValueError("open_tokenizer('bpe') needs a corpus: use load_tokenizer(cfg, vocab_size)")
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"data.tokenizer: {spec!r} is not 'bpe', 'bytes' or an existing tokenizer.json")
    return _check_fits(HFTokenizer(path, eos_id), vocab_size)


def train_bpe(cfg: DataConfig, vocab_size: int, out_path: Path) -> None:
    """Train a byte-level BPE with ``vocab_size`` ids on ``iter_documents(cfg)``; save atomically
    to ``out_path`` (written to a temp file in the same folder, then ``os.replace``)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(iter_documents(cfg), trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=".tmp-", suffix=".json")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_tokenizer(cfg: DataConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer ``cfg.tokenizer`` names, fitted to a model with ``vocab_size`` rows.

    ``"bpe"`` is trained on the corpus on first use and cached (key: corpus fingerprint + vocab).

    Raises:
        ValueError: the tokenizer has more ids than ``vocab_size`` (the message names both),
            ``vocab_size`` < 257 for "bpe" / "bytes", or as ``open_tokenizer`` / ``iter_documents``.
    """
    if cfg.tokenizer != "bpe":
        return open_tokenizer(cfg.tokenizer, vocab_size, cfg.eos_id)
    if vocab_size < 257:
        raise ValueError(f"byte-level BPE needs 257 ids (256 bytes + {EOS_TOKEN}), more than the "
                         f"model's vocab_size ({vocab_size})")
    path = cache_root(cfg) / "tokenizers" / f"bpe-{source_fingerprint(cfg)}-v{vocab_size}" / "tokenizer.json"
    if not path.is_file():
        train_bpe(cfg, vocab_size, path)
    return _check_fits(HFTokenizer(path), vocab_size)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (Radford 2019, ``bytes_to_unicode``): printable
    Latin-1 bytes map to themselves, the other 68 to U+0100 onwards, in byte order. Byte-level
    BPE vocabularies spell tokens with these characters, one character per byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bytes_tokenizer_json() -> str:
    """The ``"bytes"`` tokenizer (id b = byte b, 256 = EOS) as a ``tokenizers`` JSON string: a
    byte-level BPE without merges whose vocabulary puts each byte's character at the byte's id, so
    ``tokenizers`` / ``transformers`` encode exactly as ``ByteTokenizer`` does."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _Tok

    vocab = {ch: b for b, ch in byte_level_alphabet().items()}
    tok = _Tok(models.BPE(vocab=vocab, merges=[]))
    # no regex split: bytes are tokens on their own, spaces included, as in ByteTokenizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return tok.to_str()


def tokenizer_json(tok: Tokenizer) -> str:
    """The ``tokenizer.json`` text of ``tok`` (built for ``"bytes"``, the file itself otherwise)."""
    if isinstance(tok, ByteTokenizer):
        return bytes_tokenizer_json()
    return Path(tok.spec).read_text(encoding="utf-8")


def eos_token(tok: Tokenizer) -> str:
    """The string of ``tok``'s EOS token (``<|endoftext|>`` for ``"bytes"``)."""
    if isinstance(tok, HFTokenizer):
        return tok._tok.id_to_token(tok.eos_id)
    return EOS_TOKEN


def save_tokenizer_files(tok: Tokenizer, folder: str | Path, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``folder``, so ``transformers.AutoTokenizer.from_pretrained(folder)`` returns a
    ``PreTrainedTokenizerFast`` that encodes as ``tok`` does (its BOS in front when ``tok`` has one,
    none otherwise: the BOS policy of the module docstring) and ``open_tokenizer(folder)`` finds the
    same EOS and BOS ids."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json(tok), encoding="utf-8")
    eos = eos_token(tok)
    bos = None if tok.bos_id is None else tok._tok.id_to_token(tok.bos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
              "bos_token": bos, "unk_token": None, "add_bos_token": bos is not None, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"eos_token": eos, "pad_token": eos, **({"bos_token": bos} if bos else {})}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
