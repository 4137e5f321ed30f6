"""The BOS policy (``ndtrain.data.tokenizer``): a tokenizer.json whose post-processor puts
``<|begin_of_text|>`` in front of every encoding (as Llama 3's does: the family is pretrained with
it) gets that BOS in front of every training document, every ``generate`` prompt, every evaluated
document, and in the exported Hugging Face tokenizer alike.

References: the exported ``AutoTokenizer``'s ids (what transformers users feed the model) must
equal, exactly, the ids ndtrain trains, generates and evaluates on; transformers' logits on those
ids must equal the native model's to 1e-5 (float64, same weights, same operations in another
order). A tokenizer without such a post-processor gets no BOS anywhere (the ``"bytes"`` / BPE
tokenizers ndtrain writes; ``tests/unit/test_after_training_units.py``)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ndtrain.config import DataConfig, ModelConfig
from ndtrain.data import TokenData, prepare_data
from ndtrain.data.corpus import iter_documents
from ndtrain.data.tokenizer import open_tokenizer
from ndtrain.hf.folder import save_hf_checkpoint
from ndtrain.inference.evaluate import stream_byte_counts, stream_tokens_of
from ndtrain.model import build_model
from tests.sp_tokenizer import build_sp_tokenizer

transformers = pytest.importorskip("transformers", reason="the BOS checks load the export with transformers")

DOCS = ["the cat sat on the cat", "café ☃ on the", "naïve 🙂 cat", "the on sat"] * 6
PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bos")
    tok_path = build_sp_tokenizer(tmp / "tok", bos_post_processor=True)
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    data = DataConfig(source=str(tmp / "corpus.jsonl"), tokenizer=str(tok_path), cache_dir=str(tmp / "cache"),
                      val_fraction=0.25)
    tok = open_tokenizer(str(tok_path), 288)
    cfg = ModelConfig(vocab_size=288, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                      max_seq_len=64, rope_theta=1e4, init_std=0.1)
    model = build_model(cfg, dtype=torch.float64, seed=0).eval()
    save_hf_checkpoint(model, cfg, tmp / "hf", tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp / "hf")
    return tmp, data, tok, cfg, model, hf_tok


def test_the_tokenizer_s_bos_is_found(setup):
    _, _, tok, _, _, hf_tok = setup
    assert tok.bos_id == tok._tok.token_to_id("<|begin_of_text|>") == hf_tok.bos_token_id
    assert tok.eos_id == tok._tok.token_to_id("</s>") == hf_tok.eos_token_id


def test_training_generation_and_eval_ids_are_the_exported_tokenizer_s(setup):
    tmp, data, tok, _, _, hf_tok = setup
    want = [hf_tok(d)["input_ids"] + [tok.eos_id] for d in iter_documents(data)]
    assert all(ids[0] == tok.bos_id for ids in want)
    stream = np.concatenate([np.asarray(ids) for ids in want])
    td = TokenData(prepare_data(data, 288))  # what training reads
    assert np.array_equal(np.concatenate([td.tokens("train"), td.tokens("val")]), stream)
    assert tok.encode(PROMPT) == hf_tok(PROMPT)["input_ids"]  # what generate / the samples feed
    assert np.array_equal(stream_tokens_of(data.source, data, tok), stream)  # what eval --data reads
    counts = stream_byte_counts(tok, stream, 288)  # eval's bytes: BOS and EOS stand for none
    assert counts[stream == tok.bos_id].sum() == 0
    assert counts.sum() == sum(len(d.encode("utf-8")) for d in iter_documents(data))
    cfg = json.loads((tmp / "hf" / "config.json").read_text())
    gen = json.loads((tmp / "hf" / "generation_config.json").read_text())
    assert cfg["bos_token_id"] == gen["bos_token_id"] == tok.bos_id


def test_exported_logits_equal_native_on_the_same_text(setup):
    tmp, _, tok, _, model, hf_tok = setup
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", torch_dtype=torch.float64).eval()
    for text in (PROMPT, DOCS[1], DOCS[2]):
        ids = hf_tok(text, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == tok.encode(text)
        with torch.no_grad():
            native = model(torch.tensor([tok.encode(text)]))
            got = hf(ids).logits
        assert native.abs().max() > 0.1
        assert (got - native).abs().max().item() <= 1e-5, text
