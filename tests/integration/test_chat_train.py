"""``ndtrain train --data.format=chat --data.source=FILE.jsonl`` end to end on a tiny model.

Reference: the same packed rows read back with ``ChatData`` and the run's own sampler order; the
logged ``supervised_share`` of a step must equal that step's labels != -100 over G x T, and the
start-up line must give the train split's exact supervised count.
"""
from __future__ import annotations

import contextlib
import io
import json

from ndtrain.cli.commands import main
from ndtrain.data import GlobalBatchSampler
from ndtrain.data.chat import ChatData

G, T, STEPS = 4, 160, 4


def test_train_on_chat_jsonl(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"colour {i}?"},
        {"role": "assistant", "content": ["red", "green", "blue"][i % 3]}]}) + "\n" for i in range(40)))
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    argv = ["train", "--config", "debug", "--run-dir", str(run_dir), "--data.format=chat", f"--data.source={src}",
            "--data.tokenizer=bytes", "--data.chat_template=chatml", f"--data.cache_dir={cache}",
            f"--data.seq_len={T}", "--model.vocab_size=512", "--model.dim=32", "--model.n_layers=2",
            "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_hidden=64", f"--model.max_seq_len={T}",
            f"--training.steps={STEPS}", f"--training.global_batch_size={G}", "--training.warmup_steps=1",
            "--training.eval_batches=1", "--training.sample_tokens=4", "--logging.log_every=1",
            "--logging.progress=plain", "--logging.plot=false"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    printed = buf.getvalue()
    (folder,) = (cache / "chat").iterdir()
    data = ChatData(folder)
    s = data.summary(T)["train"]
    lengths = [b - a for a, b in zip(data._split("train")[0][:-1], data._split("train")[0][1:])]
    assert all((T + 1) / 3 < n <= (T + 1) / 2 for n in lengths)  # exactly two whole conversations per row
    assert s["conversations"] == 39 and s["rows"] == 20 and s["truncated"] == 0
    assert f"chat data: 39 conversations -> 20 packed sequences of {T} | supervised (assistant) labels " \
           f"{s['supervised_labels']:,} = " in printed
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "supervised_share" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    sampler = GlobalBatchSampler(data.num_sequences("train", T), G, 0)
    for r in steps:
        _, labels, _ = data.get("train", sampler.next_global(), T)
        assert r["supervised_share"] == int((labels != -100).sum()) / (G * T), r["step"]
        assert r["loss"] == r["loss"] and r["loss"] > 0
    assert (run_dir / "checkpoints").is_dir() and "val_loss" in rows[-1]
