"""``ndtrain data prepare``: worker-count-independent files, resume after an interruption, the CLI;
Hugging Face ``datasets`` sources (skipped without the package)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ndtrain.data.megatron_index import MegatronIndex
from ndtrain.data.prepare import prepare
from ndtrain.data.tokenizer import ByteTokenizer

FILES = ("data.bin", "data.idx", "manifest.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(1)
    docs = [" ".join(f"w{int(x)}" for x in rng.integers(0, 999, int(n))) for n in rng.integers(1, 60, 120)]
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:70]))
    for i, t in enumerate(docs[70:]):
        (d / f"b{i:03d}.txt").write_text(t)
    return d, docs


def _bytes(folder):
    return {f: (folder / f).read_bytes() for f in FILES}


def test_one_and_two_workers_write_identical_files(corpus, tmp_path):
    d, docs = corpus
    srcs = [str(d / "a.jsonl"), str(d / "b*.txt")]
    m1 = prepare(srcs, tmp_path / "w1", workers=1, chunk_docs=16, progress=False)
    prepare(srcs, tmp_path / "w2", workers=2, chunk_docs=16, progress=False)
    assert _bytes(tmp_path / "w1") == _bytes(tmp_path / "w2")
    ix = MegatronIndex(tmp_path / "w1" / "data")
    eos = ByteTokenizer().eos_id
    assert ix.num_documents == len(docs) == m1["num_documents"] == 120 and m1["num_parts"] == 8
    for i in (0, 69, 70, 119):  # documents in reading order, each followed by EOS
        assert ix.document(i).tolist() == list(docs[i].encode()) + [eos]
    assert not (tmp_path / "w1" / "parts").exists()


def test_interrupted_prepare_resumes_to_the_same_files(corpus, tmp_path):
    d, _ = corpus
    srcs = [str(d)]
    prepare(srcs, tmp_path / "full", chunk_docs=10, progress=False)
    out = tmp_path / "cut"
    assert prepare(srcs, out, chunk_docs=10, progress=False, stop_after_parts=5) == {"stopped_after_parts": 5}
    assert len(list((out / "parts").glob("part-*.len.npy"))) == 5 and not (out / "manifest.json").exists()
    (out / "parts" / "part-000003.len.npy").unlink()  # killed while publishing part 3: it is redone
    prepare(srcs, out, chunk_docs=10, progress=False)
    assert _bytes(out) == _bytes(tmp_path / "full")
    again = prepare(srcs, out, chunk_docs=10, progress=False)  # finished: the same inputs do nothing
    assert again.pop("already_prepared") is True and _bytes(out) == _bytes(tmp_path / "full")
    with pytest.raises(ValueError, match=r"holds a prepare of other inputs \(chunk_docs differ\)"):
        prepare(srcs, out, chunk_docs=11, progress=False)  # a finished folder refuses other inputs too
    with pytest.raises(ValueError, match=r"holds a prepare of other inputs \(chunk_docs differ\)"):
        (out / "manifest.json").unlink()
        prepare(srcs, out, chunk_docs=11, progress=False)


def test_cli_prepare_and_train_source(corpus, tmp_path, capsys):
    from ndtrain.cli.commands import main
    from ndtrain.config import DataConfig
    from ndtrain.data.mixture import MixtureData, prepare_mixture

    d, docs = corpus
    assert main(["data", "prepare", str(d / "a.jsonl"), "--out", str(tmp_path / "p"), "--workers", "1",
                 "--no-progress"]) == 0
    assert "prepared 70 documents" in capsys.readouterr().out
    cfg = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path), seq_len=8, val_fraction=0.1,
                     sources=f"megatron:{tmp_path / 'p'}@1")
    data = MixtureData(prepare_mixture(cfg, 300), document_mask=True)
    flat = np.concatenate([list(t.encode()) + [256] for t in docs[:70]])
    n_train = len(flat) - round(len(flat) * 0.1)
    inputs = data.get("train", range(20), 8)[0]
    win = data.locate("train", range(20), 8)[1]
    for r in range(20):
        assert inputs[r].tolist() == flat[win[r] * 8:win[r] * 8 + 8].tolist()
        assert win[r] * 8 + 9 <= n_train
    assert data.num_tokens("val") == len(flat) - n_train
    assert main(["data", "prepare", str(tmp_path / "none*"), "--out", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.strip() == f"ndtrain: invalid config: data prepare: data.source: '{tmp_path}/none*' matched no files"


def test_hf_sources_text_and_tokens(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed (pip install 'ndtrain[datasets]')")
    from ndtrain.config import DataConfig
    from ndtrain.data.mixture import MixtureData, prepare_mixture

    texts = [f"document {i} " * (5 + i % 7) for i in range(60)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "disk"))
    (tmp_path / "folder").mkdir()
    toks = [[1000 + i] * (4 + i % 5) for i in range(40)]
    (tmp_path / "folder" / "train.jsonl").write_text("".join(json.dumps({"tokens": t}) + "\n" for t in toks))
    sources = [{"kind": "hf", "path": str(tmp_path / "disk"), "weight": 1},
               {"kind": "hf", "path": str(tmp_path / "folder"), "field": "tokens", "weight": 1, "streaming": True}]
    cfg = DataConfig(tokenizer="bytes", cache_dir=str(tmp_path / "cache"), seq_len=8, val_fraction=0.1,
                     sources=json.dumps(sources))
    data = MixtureData(prepare_mixture(cfg, 2048), document_mask=True)
    text_flat = np.concatenate([list(t.encode()) + [256] for t in texts])
    tok_flat = np.concatenate(toks)
    assert len(data.streams[0]["train"].tokens) + len(data.streams[0]["val"].tokens) == len(text_flat)
    assert np.array_equal(np.asarray(data.streams[1]["train"].tokens), tok_flat[:len(data.streams[1]["train"].tokens)])
    src = data.locate("train", range(30), 8)[0]
    inputs, _, ids = data.get("train", range(30), 8)
    for r in np.flatnonzero(src == 1):  # token documents keep their boundaries: ids change with the token value
        row = inputs[r].numpy()
        assert ids[r].tolist() == (np.cumsum(np.r_[0, row[1:] != row[:-1]])).tolist()
