"""``data.sources``: the sources of a mixture, parsed from the config and resolved for the ranks.

Forms of the key (a string field; a YAML list is stored as its JSON text):

* YAML: a list of mappings, ``- {kind: tokens, path: a.npy, weight: 0.7}``;
* JSON text: ``[{"kind": "megatron", "path": "web", "weight": 0.7}, ...]``;
* compact (command line): ``KIND:PATH@WEIGHT;KIND:PATH@WEIGHT`` (``;`` between sources).

Kinds: ``text`` (a path / glob / comma list of txt / JSONL / parquet, tokenized into the cached shards
of ``ndtrain.data.shards``), ``tokens`` (a ``.npy`` or raw ``uint16`` / ``uint32`` token file, with
an optional ``.npy`` of document start offsets, else documents end at ``eos_id``), ``megatron``
(``PREFIX.bin`` / ``PREFIX.idx``, or an ``ndtrain data prepare`` folder), ``hf`` (a Hugging Face
``datasets`` folder: ``load_from_disk`` or a data folder ``load_dataset`` reads; ``field`` is a text
column, tokenized once into the cache, or ``tokens``). Each source has a ``weight`` or a
``budget_tokens`` (weights then follow the budgets); all sources use one kind of the two.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ndtrain.config import DataConfig

KINDS = ("text", "tokens", "megatron", "hf")


@dataclass
class SourceSpec:
    kind: str  # text | tokens | megatron | hf
    path: str  # file, prefix, folder, glob or comma list (text)
    weight: float = 0.0  # share of the sequences drawn (normalised over the sources)
    budget_tokens: int = 0  # instead of a weight: tokens wanted from this source (weights follow them)
    name: str = ""  # label of the logged share ("" = s<index>)
    field: str = ""  # text / hf: the text column ("" = data.text_field); hf: "tokens" for token ids
    dtype: str = "uint16"  # tokens, raw files: uint16 | uint32
    offsets: str = ""  # tokens: .npy of each document's first-token offset ("" = split at eos_id)
    eos_id: int = -1  # tokens without offsets: the id ending each document (-1 = one stream)
    streaming: bool = False  # hf: read the data folder with load_dataset(streaming=True)


def _compact(text: str) -> list[dict]:
    out = []
    for i, part in enumerate(p.strip() for p in text.split(";")):
        if not part:
            continue
        kind, sep, rest = part.partition(":")
        if not sep or "@" not in rest:
            raise ValueError(f"data.sources entry {i} ({part!r}) is not KIND:PATH@WEIGHT")
        path, _, weight = rest.rpartition("@")
        try:
            out.append({"kind": kind.strip(), "path": path.strip(), "weight": float(weight)})
        except ValueError:
            raise ValueError(f"data.sources entry {i} ({part!r}): weight {weight!r} is not a number") from None
    return out


def parse_sources(value) -> list[SourceSpec]:
    """``data.sources`` (str, or an already loaded list) as specs with weights normalised to sum 1.
    Raises ValueError naming the entry: unknown kind / key, no path, no or mixed weight / budget."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"data.sources: invalid JSON ({e})") from None
        else:
            value = _compact(text)
    if not isinstance(value, list):  # ValueError, as every bad data setting: launch makes it a ConfigError
        raise ValueError(f"data.sources must be a list of sources, not {type(value).__name__}")  # noqa: TRY004
    names = {f.name for f in dataclasses.fields(SourceSpec)}
    specs = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ValueError(f"data.sources entry {i} must be a mapping, not {type(entry).__name__}")  # noqa: TRY004
        unknown = sorted(set(entry) - names)
        if unknown:
            raise ValueError(f"data.sources entry {i}: unknown key {unknown[0]!r}; keys: {', '.join(sorted(names))}")
        spec = SourceSpec(**entry)
        if spec.kind not in KINDS:
            raise ValueError(f"data.sources entry {i}: kind {spec.kind!r} is not one of {', '.join(KINDS)}")
        if not spec.path:
            raise ValueError(f"data.sources entry {i}: no path")
        spec.name = spec.name or f"s{i}"
        specs.append(spec)
    return _normalise(specs)


def _normalise(specs: list[SourceSpec]) -> list[SourceSpec]:
    if not specs:
        return specs
    by_budget = [s.budget_tokens > 0 for s in specs]
    by_weight = [s.weight > 0 for s in specs]
    for i, s in enumerate(specs):
        if s.weight < 0 or s.budget_tokens < 0 or by_budget[i] == by_weight[i]:
            raise ValueError(f"data.sources entry {i} ({s.name}): give exactly one of weight > 0 or "
                             f"budget_tokens > 0 (weight={s.weight}, budget_tokens={s.budget_tokens})")
    if any(by_budget) and not all(by_budget):
        raise ValueError("data.sources: either every source has a weight or every source a budget_tokens")
    raw = [float(s.budget_tokens) if s.budget_tokens else s.weight for s in specs]
    total = sum(raw)
    for s, w in zip(specs, raw):
        s.weight = w / total
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"data.sources: names repeat ({[s.name for s in specs]})")
    return specs


def resolve(spec: SourceSpec, cfg: DataConfig, tokenizer_spec: str, vocab_size: int) -> dict:
    """What a rank opens for ``spec`` (``ndtrain.data.pretokenized.open_stream``): text becomes its
    prepared shard folder, hf its tokenized cache folder, the rest their checked paths. Raises
    ValueError (a missing path, an unreadable corpus) or ImportError text for hf without ``datasets``."""
    out = {"name": spec.name, "weight": spec.weight}
    if spec.kind == "text":
        from ndtrain.data.shards import prepare_data

        sub = dataclasses.replace(cfg, source=spec.path, text_field=spec.field or cfg.text_field,
                                  tokenizer=tokenizer_spec)
        return {**out, "kind": "shards", "path": str(prepare_data(sub, vocab_size))}
    if spec.kind == "hf":
        from ndtrain.data.hf_source import prepare_hf

        return {**out, "kind": "megatron", "path": str(prepare_hf(spec, cfg, tokenizer_spec, vocab_size) / "data")}
    path = Path(spec.path).expanduser()
    if spec.kind == "megatron":
        from ndtrain.data.megatron_index import MegatronIndex

        prefix = path / "data" if path.is_dir() else path
        MegatronIndex(prefix)  # checks the files now, before any rank starts
        manifest = path / "manifest.json"
        if path.is_dir() and manifest.is_file():  # a data prepare folder: its tokenizer must be the run's
            from ndtrain.data.prepare import tokenizer_id

            made, ours = json.loads(manifest.read_text()).get("tokenizer"), tokenizer_id(tokenizer_spec)
            if made != ours:
                raise ValueError(f"data.sources {spec.name}: {path} was prepared with tokenizer {made}, "
                                 f"this run's data.tokenizer is {ours}")
        return {**out, "kind": "megatron", "path": str(prefix.resolve())}
    if not path.is_file():
        raise ValueError(f"data.sources {spec.name}: token file {path} does not exist")
    if spec.offsets and not Path(spec.offsets).expanduser().is_file():
        raise ValueError(f"data.sources {spec.name}: offsets file {spec.offsets} does not exist")
    if spec.dtype not in ("uint16", "uint32"):
        raise ValueError(f"data.sources {spec.name}: dtype {spec.dtype!r} is not uint16 or uint32")
    return {**out, "kind": "tokens", "path": str(path.resolve()), "dtype": spec.dtype,
            "offsets": str(Path(spec.offsets).expanduser().resolve()) if spec.offsets else "",
            "eos_id": spec.eos_id}


def mixture_key(resolved: list[dict], extra: dict) -> str:
    blob = json.dumps({"sources": resolved, **extra}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
