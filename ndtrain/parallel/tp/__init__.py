"""Tensor + sequence parallel (Megatron-LM): column / row splits, SP, vocab-parallel loss."""
