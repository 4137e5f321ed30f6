"""Every command of the user guides (``docs/guides/*.md``) runs, on a tiny model.

How a guide marks its commands (the HTML comments are invisible on a rendered page):

* A fenced ``bash`` or ``python`` block directly after ``<!-- runnable -->`` is run;
  ``<!-- runnable expect="TEXT" -->`` also requires TEXT in what the block printed;
  ``<!-- runnable slow ... -->`` blocks (starting fresh interpreters, e.g. torchrun: ~30 s) run in
  ``test_slow_guide_blocks_run`` (marked slow) instead of the default test.
* A block after ``<!-- not-runnable: REASON -->`` is only shown (a download, several machines,
  a cluster); the reason is required. Every bash / python block carries one of the two marks
  (``test_every_block_is_marked``), so a new command cannot silently go untested.

How the blocks run (``test_guides_run``): the guides in ``GUIDES`` order, one after another, in one
temporary working directory (the export guide uses the quickstart's ``runs/debug``), after the
fixtures the guides name are created there: ``my_corpus.txt`` / ``my_docs.jsonl`` (ndtrain's own
source text) and ``llama-3.2-1b/``, a tiny Hugging Face Llama folder with a ``tokenizer.json``
standing in for the downloaded model. In a bash block, backslash-continued lines are joined and
``#`` comments dropped; a command starting with ``ndtrain`` runs in this process through
``ndtrain.cli.commands.main`` (no interpreter start per command), any other through ``bash -c`` with the
virtual environment's ``bin`` first on ``PATH``. Each must exit 0. A python block is ``exec``'d.

The tiny overrides, applied to every command that trains (``ndtrain train`` or
``-m ndtrain.cli.commands train``): process counts (``--nproc N``, ``--nproc-per-node N``) become 1 (the
torchrun rehearsal keeps torchrun's environment path, with one rank); the keys in ``CAPS`` are
lowered to their cap when the command sets them higher; the keys of ``TINY`` are appended when the
command does not set them, and the model keys of ``TINY_MODEL`` too when ``--config`` names a
preset (a YAML path such as a converted model's ``config.yaml`` keeps its model). So commands keep
their meaning (a re-run with a larger ``training.steps`` still resumes and trains further) at a
few steps of a 32-wide model.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["quickstart.md", "own_data.md", "finetune_hf.md", "lora.md", "export.md", "multinode.md"]
CAPS = {"training.steps": 6, "data.seq_len": 32, "training.warmup_steps": 2}
TINY = {"data.source": "my_corpus.txt", "data.seq_len": "32", "training.steps": "4",
        "training.global_batch_size": "4", "training.micro_batch_size": "0", "training.warmup_steps": "1",
        "training.eval_every": "0", "training.eval_batches": "1", "training.sample_tokens": "8",
        "logging.log_every": "2", "logging.progress": "plain", "logging.plot": "false"}
TINY_MODEL = {"model.vocab_size": "512", "model.dim": "32", "model.n_layers": "2", "model.n_heads": "4",
              "model.n_kv_heads": "2", "model.ffn_hidden": "64", "model.max_seq_len": "64"}
_MARK = re.compile(r'^<!-- (runnable( slow)?(?: expect="([^"]*)")?|not-runnable: (.+\S)) -->$')


def blocks(path: Path) -> list[dict]:
    """The fenced bash / python blocks of a guide: language, code, mark (runnable / not /
    None), expected text and the line they start on."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^```(bash|python)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        mark = _MARK.match(lines[i - 1]) if i > 0 else None
        j = lines.index("```", i + 1)
        out.append({"lang": fence.group(1), "code": "\n".join(lines[i + 1:j]), "line": i + 1,
                    "runnable": bool(mark) and mark.group(1).startswith("runnable"),
                    "marked": bool(mark), "slow": bool(mark and mark.group(2)),
                    "expect": mark.group(3) if mark else None})
        i = j + 1
    return out


def commands(code: str) -> list[str]:
    """Shell lines of a bash block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [c for c in (line.split(" #")[0].strip() for line in joined.splitlines()) if c and not c.startswith("#")]


def tiny(argv: list[str], cache: Path) -> list[str]:
    """``argv`` of a training command with the module docstring's tiny overrides applied."""
    out, keys, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--nproc", "--nproc-per-node"):
            out += [arg, "1"]
            i += 2
            continue
        m = re.match(r"^--([a-z_]+\.[a-z_]+)=(.*)$", arg)
        if m:
            key, value = m.groups()
            keys[key] = value
            if key in CAPS and float(value) > CAPS[key]:
                arg = f"--{key}={CAPS[key]}"
        out.append(arg)
        i += 1
    config = out[out.index("--config") + 1] if "--config" in out else "default"
    extra = dict(TINY, **({} if config.endswith((".yaml", ".yml")) else TINY_MODEL))
    extra["data.cache_dir"] = str(cache)
    return out + [f"--{k}={v}" for k, v in extra.items() if k not in keys]


def _trains(argv: list[str]) -> bool:
    return "train" in argv and any(a in ("ndtrain", "ndtrain.cli.commands") or a.endswith("/ndtrain") for a in argv)


def _run_ndtrain(argv: list[str]) -> tuple[int, str]:
    from ndtrain.cli.commands import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: --help / --version / usage errors
            rc = e.code or 0
    return rc, buf.getvalue()


def _run_block(block: dict, work: Path) -> str:
    if block["lang"] == "python":
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            # the guide's own code, run as a reader would paste it
            exec(compile(block["code"], f"<doc block line {block['line']}>", "exec"), {"__name__": "__doc__"})  # noqa: S102
        return buf.getvalue()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    printed = ""
    for cmd in commands(block["code"]):
        argv = shlex.split(cmd)
        if _trains(argv):
            argv = tiny(argv, work / "cache")
        if argv[0] == "ndtrain":
            rc, out = _run_ndtrain(argv[1:])
        else:
            proc = subprocess.run(["bash", "-c", _shell(argv)], capture_output=True, text=True, timeout=300,
                                  env=env, cwd=work, check=False)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        assert rc == 0, f"line {block['line']}: {cmd}\n-> {shlex.join(argv)}\nexit {rc}\n{out[-3000:]}"
        printed += out
    return printed


def _shell(argv: list[str]) -> str:
    """``argv`` quoted for bash, leading ``VAR=value`` assignments left as assignments."""
    n = next(i for i, a in enumerate(argv) if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", a))
    return " ".join(argv[:n]) + " " + shlex.join(argv[n:])


def _corpus_text() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "ndtrain").glob("*.py")))[:60000]


def _tiny_hf_llama(folder: Path, text: str) -> None:
    """A 2-layer, 32-wide Llama in the Hugging Face layout, with a byte-level BPE tokenizer.json
    (512 entries, ``<|end_of_text|>`` as EOS) trained on ``text``."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))


def test_every_block_is_marked():
    for name in GUIDES:
        for b in blocks(ROOT / "docs" / "guides" / name):
            assert b["marked"], f"docs/guides/{name}:{b['line']}: mark the block runnable or not-runnable: reason"


def test_tiny_overrides():
    argv = shlex.split("ndtrain train --config debug --nproc 8 --training.steps=200 --data.seq_len=16")
    out = tiny(argv, Path("/c"))
    assert out[:7] == ["ndtrain", "train", "--config", "debug", "--nproc", "1", "--training.steps=6"]
    assert "--data.seq_len=16" in out and "--data.seq_len=32" not in out  # under the cap: kept
    assert "--model.dim=32" in out and "--data.cache_dir=/c" in out and "--training.steps=4" not in out
    converted = tiny(shlex.split("ndtrain train --config x/config.yaml"), Path("/c"))
    assert not any(a.startswith("--model.") for a in converted)


def test_slurm_script_syntax():
    script = ROOT / "scripts" / "slurm_train.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "--rdzv-backend c10d" in text and "-m ndtrain.cli.commands train" in text and '"$@"' in text


def _fixtures(work: Path, monkeypatch, hf: bool) -> None:
    monkeypatch.chdir(work)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CI"):
        monkeypatch.delenv(var, raising=False)
    text = _corpus_text()
    (work / "my_corpus.txt").write_text(text)
    (work / "my_docs.jsonl").write_text("".join(json.dumps({"text": text[i:i + 2000]}) + "\n"
                                                for i in range(0, len(text), 2000)))
    if hf:
        _tiny_hf_llama(work / "llama-3.2-1b", text)


def _run_guides(work: Path, slow: bool) -> int:
    ran = 0
    for name in GUIDES:
        for b in blocks(ROOT / "docs" / "guides" / name):
            if not b["runnable"] or b["slow"] != slow:
                continue
            out = _run_block(b, work)
            ran += 1
            if b["expect"]:
                assert b["expect"] in out, f"docs/guides/{name}:{b['line']}: {b['expect']!r} not in\n{out[-3000:]}"
    return ran


@pytest.mark.slow  # torchrun and two fresh interpreters: ~30 s on a loaded 2-core machine
def test_slow_guide_blocks_run(tmp_path, monkeypatch):
    _fixtures(tmp_path, monkeypatch, hf=False)
    assert _run_guides(tmp_path, slow=True) >= 1
    assert (tmp_path / "runs" / "rehearsal" / "metrics.jsonl").is_file()


def test_guides_run(tmp_path, monkeypatch):
    _fixtures(tmp_path, monkeypatch, hf=True)
    assert _run_guides(tmp_path, slow=False) >= 12
    assert (tmp_path / "runs" / "debug" / "checkpoints").is_dir()
    assert json.loads((tmp_path / "eval.json").read_text())


FEATURE_GUIDES = ["sft.md", "data.md", "evaluation.md", "packed_documents.md"]  # guides of docs/ itself, run one by one after the same fixtures


@pytest.mark.parametrize("name", FEATURE_GUIDES)
def test_feature_guide_runs(name, tmp_path, monkeypatch):
    _fixtures(tmp_path, monkeypatch, hf=False)
    ran = 0
    for b in blocks(ROOT / "docs" / name):
        assert b["marked"], f"docs/{name}:{b['line']}: mark the block runnable or not-runnable: reason"
        if b["runnable"] and not b["slow"]:
            out = _run_block(b, tmp_path)
            ran += 1
            if b["expect"]:
                assert b["expect"] in out, f"docs/{name}:{b['line']}: {b['expect']!r} not in\n{out[-3000:]}"
    assert ran >= 3
