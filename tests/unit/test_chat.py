"""Instruction data (``ndtrain.data.chat``, ``ndtrain.data.chat_template``).

References: the ChatML text written out by hand; ``transformers``' ``apply_chat_template`` on a tiny
tokenizer folder built here (its own template, BOS and end-of-turn tokens); supervised positions
and counts computed by hand from the byte offsets of the assistant replies; a float64 model's loss
and gradients with a trailing user turn changed (no assistant token sees it: a mask that let one
user label through would change them) against the unchanged data.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ndtrain.config import ConfigError, DataConfig, validate
from ndtrain.data.chat import ChatData, encode_with_mask, open_data, prepare_chat
from ndtrain.data.chat_template import ChatTemplate, load_chat_template
from tests.utils import tiny_config

END = "<|im_end|>\n"


def _conv(i: int, tail: str = "") -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"what is {i} + {i}?"},
            {"role": "assistant", "content": f"{2 * i}."}, {"role": "user", "content": "and twice that?"},
            {"role": "assistant", "content": f"it is {4 * i}"}]
    return msgs + ([{"role": "user", "content": tail}] if tail else [])


def _write(path: Path, convs: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


def _chat(tmp_path: Path, convs, name="c.jsonl", seq_len=64, **kw) -> ChatData:
    cfg = DataConfig(source=str(_write(tmp_path / name, convs)), tokenizer=kw.pop("tokenizer", "bytes"),
                     chat_template=kw.pop("chat_template", "chatml"), cache_dir=str(tmp_path / "cache"),
                     val_fraction=0.25, **kw)
    return ChatData(prepare_chat(cfg, 512), documents=True)


def test_chatml_renders_as_documented():
    t = load_chat_template("chatml", "bytes")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert t.render(msgs) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert t.render(msgs[:2], add_generation_prompt=True).endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    text, spans = t.assistant_spans(msgs)
    assert [text[a:b] for a, b in spans] == ["A" + END]


def _hand_labels(convs, T):
    """Expected (inputs, labels, documents) rows by hand: bytes of the ChatML text, a label where
    the next byte lies in an assistant reply or its end marker, conversations packed greedily into
    rows of T + 1, EOS (256) padding as the next document."""
    rows = [[]]  # (byte, supervised, document)
    for c in convs:
        item = []
        for m in c:
            head, body = f"<|im_start|>{m['role']}\n", m["content"] + END
            item += [(x, False) for x in head.encode()] + [(x, m["role"] == "assistant") for x in body.encode()]
        assert len(item) <= T + 1
        if rows[-1] and len(rows[-1]) + len(item) > T + 1:
            rows.append([])
        d = rows[-1][-1][2] + 1 if rows[-1] else 0
        rows[-1] += [(x, sup, d) for x, sup in item]
    out = []
    for row in rows:
        pad = T + 1 - len(row)
        toks = [x for x, _, _ in row] + [256] * pad
        sup = [s for _, s, _ in row] + [False] * pad
        doc = [d for _, _, d in row] + [row[-1][2] + 1] * pad
        labels = [toks[t + 1] if sup[t + 1] and doc[t + 1] == doc[t] else -100 for t in range(T)]
        out.append((toks[:T], labels, doc[:T]))
    return out


def test_labels_are_the_assistant_bytes_exactly(tmp_path):
    convs = [_conv(i) for i in range(8)]
    T = 400  # two ~200-byte conversations per row, then EOS padding
    data = _chat(tmp_path, convs, seq_len=T)
    train = convs[:6]  # val_fraction 0.25 of 8: the last 2 are the val split
    hand = _hand_labels(train, T)
    assert data.num_sequences("train", T) == len(hand) == 3
    x, y, d = data.get("train", range(len(hand)), T)
    for r, (toks, labels, doc) in enumerate(hand):
        assert x[r].tolist() == toks and y[r].tolist() == labels and d[r].tolist() == doc, r
    # the supervised share: each reply + its end marker, minus nothing (no conversation starts supervised)
    n_hand = sum(len(m["content"]) + len(END) for c in train for m in c if m["role"] == "assistant")
    assert int((y != -100).sum()) == data.supervised_labels("train", T) == n_hand
    assert data.meta["supervised_tokens"]["train"] == n_hand
    s = data.summary(T)["train"]
    assert s["supervised_share"] == n_hand / (3 * T) and s["truncated"] == 0 and s["conversations"] == 6
    assert data.console_line(T).startswith(f"chat data: 6 conversations -> 3 packed sequences of {T} | "
                                           f"supervised (assistant) labels {n_hand:,} = ")


def test_truncation_and_counts_at_a_short_seq_len(tmp_path):
    convs = [_conv(i) for i in range(4)]
    data = _chat(tmp_path, convs)
    T = 90  # every conversation (~200 bytes) is cut to 91 tokens: one per row
    assert data.num_sequences("train", T) == 3 and data.summary(T)["train"]["truncated"] == 3
    _, y, _ = data.get("train", [0, 1, 2], T)
    assert int((y != -100).sum()) == data.supervised_labels("train", T)
    with pytest.raises(IndexError, match=r"sequence index out of range \[0, 3\) for split 'train'"):
        data.get("train", [3], T)


def _tiny_hf_folder(folder: Path) -> None:
    """A byte-level BPE tokenizer.json with ChatML-like special tokens and a Jinja template of its
    own (BOS at the start, a system default, a loop.first test) in tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = " ".join(json.dumps(_conv(i)) for i in range(50))
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<s>", "<|eot|>", "<|start|>")])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    template = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start|>system\nYou help.<|eot|>\n{% endif %}"
                "{% for m in messages %}{% if loop.first and m['role'] == 'system' %}<|start|>system\n"
                "{{ m['content'] | trim }}<|eot|>\n{% else %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|eot|>\n"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|eot|>",
        "chat_template": template}))


def test_template_equals_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tok"
    _tiny_hf_folder(folder)
    convs = [_conv(i) for i in range(3)] + [_conv(7)[1:], [{"role": "user", "content": "héllo ✓"},
                                                            {"role": "assistant", "content": "ça va ✓✓"}]]
    data = _chat(tmp_path, convs, tokenizer=str(folder / "tokenizer.json"), chat_template="")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    got = [data.tokens("train")[a:b].tolist() for a, b in zip(data._split("train")[0][:-1], data._split("train")[0][1:])]
    got += [data.tokens("val")[a:b].tolist() for a, b in zip(data._split("val")[0][:-1], data._split("val")[0][1:])]
    t = load_chat_template("", str(folder / "tokenizer.json"))
    for c, ids in zip(convs, got, strict=True):
        ref = hf.apply_chat_template(c, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert ids == list(ref)
        assert t.render(c) == hf.apply_chat_template(c, tokenize=False)
        assert t.render(c[:2], add_generation_prompt=True) == hf.apply_chat_template(
            c[:2], tokenize=False, add_generation_prompt=True)
    # the mask: decoding the supervised tokens gives the replies with their end-of-turn marker
    text, spans = t.assistant_spans(convs[0])
    ids, mask = encode_with_mask(data.tokenizer, text, spans)
    assert hf.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if m]) == "0.<|eot|>\nit is 0<|eot|>\n"


def _loss_and_grads(data: ChatData, T: int):
    from ndtrain.model import Transformer

    cfg = tiny_config({"model.vocab_size": 512, "model.max_seq_len": 256, "data.seq_len": T})
    torch.manual_seed(0)
    model = Transformer(cfg.model).double()
    x, y, _ = data.get("train", range(data.num_sequences("train", T)), T)
    loss = torch.nn.functional.cross_entropy(model(x).double().flatten(0, 1), y.flatten(), reduction="sum")
    loss.backward()
    return x, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_user_turns_carry_no_loss(tmp_path):
    """A trailing user turn changed (same length): inputs differ, loss and gradients are bitwise
    the same; the same change in the last assistant turn changes the loss."""
    torch.set_num_threads(1)
    T = 256  # each conversation (237 bytes) whole in its own row
    tail = [_conv(i, tail="thanks, bye") for i in range(4)]
    planted = [_conv(i, tail="THANKS, BYE") for i in range(4)]
    reply = [c[:-2] + [dict(c[-2], content=c[-2]["content"].upper())] + c[-1:] for c in tail]
    runs = []
    for name, convs in (("a", tail), ("b", planted), ("c", reply)):
        (tmp_path / name).mkdir()
        runs.append(_loss_and_grads(_chat(tmp_path / name, convs), T))
    (xa, la, ga), (xb, lb, gb), (xc, lc, _) = runs
    assert xa.shape == (3, T) and not torch.equal(xa, xb) and not torch.equal(xa, xc)
    assert la == lb and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert lc != la  # the same change in an assistant turn is seen: the test can fail


def test_chat_config_rules():
    validate(tiny_config({"data.format": "chat", "data.tokenizer": "bytes"}), 1)
    with pytest.raises(ConfigError, match=r"data.format \(jsonl\) must be text\|chat"):
        validate(tiny_config({"data.format": "jsonl"}), 1)
    with pytest.raises(ConfigError, match="data.format=chat needs data.tokenizer = a tokenizer.json"):
        validate(tiny_config({"data.format": "chat", "data.tokenizer": "bpe"}), 1)


def test_bad_conversation_and_missing_template_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": _conv(1)}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    cfg = DataConfig(source=str(bad), tokenizer="bytes", chat_template="chatml", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'messages' must be a non-empty list of"):
        prepare_chat(cfg, 512)
    with pytest.raises(ValueError, match="data.chat_template is empty and tokenizer 'bytes' has no chat template"):
        load_chat_template("", "bytes")
    assert type(open_data(prepare_chat(DataConfig(
        source=str(_write(tmp_path / "ok.jsonl", [_conv(1), _conv(2)])), tokenizer="bytes",
        chat_template="chatml", cache_dir=str(tmp_path / "c")), 512))) is ChatData


def test_max_corpus_bytes_keeps_whole_conversations(tmp_path):
    convs = [_conv(i) for i in range(8)]  # 198 bytes each for i < 3 (the ChatML text of _conv)
    cap = 3 * 198 + 197  # three whole conversations fit, not a fourth
    data = _chat(tmp_path, convs, max_corpus_bytes=cap)
    assert data.meta["num_documents"] == {"train": 2, "val": 1}
    assert data.num_tokens("train") + data.num_tokens("val") == 3 * 198
    assert json.loads((data.path / "corpus_bytes.json").read_text()) == {"bytes_read": 3 * 198, "truncated": True}


def test_where_the_tokenizers_own_template_comes_from(tmp_path):
    folder = tmp_path / "tok"
    _tiny_hf_folder(folder)
    spec = str(folder / "tokenizer.json")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template("", spec).render(msgs) == "D<s>"  # the list form: its "default"
    (folder / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template("", spec).render(msgs) == "J2"  # the .jinja file beside it wins
    assert load_chat_template("chatml", spec).render(msgs).startswith("<|im_start|>user\nhi")
    last_only = ChatTemplate("{{ messages[-1]['content'] }}", "last-only")
    with pytest.raises(ValueError, match="chat template last-only: the render up to message 1 is not a prefix"):
        last_only.assistant_spans(msgs + [{"role": "user", "content": "bye"}])
