"""Data pipeline: corpus sources -> tokenizer -> token shards (memmap) -> global batch sampler.

    path = prepare_data(cfg.data, cfg.model.vocab_size)       # tokenize once, cached
    data = TokenData(path)
    sampler = GlobalBatchSampler(data.num_sequences("train", T), G, seed)
    idx = local_slice(sampler.next_global(), dp_rank, dp_size)
    inputs, labels, docs = data.get("train", idx, T)           # (G/dp, T) each, labels shifted
"""
from ndtrain.data.corpus import iter_documents, source_fingerprint
from ndtrain.data.sampler import GlobalBatchSampler, local_slice, val_batches
from ndtrain.data.shards import TokenData, prepare_data
from ndtrain.data.tokenizer import Tokenizer, load_tokenizer, open_tokenizer

__all__ = [
    "GlobalBatchSampler",
    "TokenData",
    "Tokenizer",
    "iter_documents",
    "load_tokenizer",
    "local_slice",
    "open_tokenizer",
    "prepare_data",
    "source_fingerprint",
    "val_batches",
]
