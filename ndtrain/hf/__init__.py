"""Hugging Face checkpoints in and out: ``folder`` reads and writes ``save_pretrained``-style folders
and picks the family; one module per family maps config and weights both ways (``llama``, ``moe``
for Mixtral and DeepSeek-V3, ``qwen3_moe``, ``qwen3_next``, ``mamba2``); ``common`` is what they share;
``rules`` decides from a config alone which family a model exports as and what it would lose
(``export_problem``: refused before writing, noted at ``ndtrain train`` launch).

    cfg, model = load_hf_checkpoint("path/to/hf_folder")      # ndtrain.hf.folder
"""


def load_hf_checkpoint(*args, **kwargs):
    """``ndtrain.hf.folder.load_hf_checkpoint`` (imports torch only when called)."""
    from ndtrain.hf.folder import load_hf_checkpoint as load
    return load(*args, **kwargs)


def save_hf_checkpoint(*args, **kwargs):
    """``ndtrain.hf.folder.save_hf_checkpoint``."""
    from ndtrain.hf.folder import save_hf_checkpoint as save
    return save(*args, **kwargs)
