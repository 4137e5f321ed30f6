"""Validation in the training loop: the run's held-out split (``val_loss``) and every named set of
``eval.sets`` (``val_loss/NAME``), each over ``training.eval_batches`` fixed global batches.

Batch b of a split holds its sequences ``(b*G + j) mod n`` for j < G (G = ``global_batch_size``,
n = sequences in the split), cut per dp rank as training's batches are; the loss is token-weighted
over the whole pass (``Trainer.eval_loss``: the same forward-only path under every layout), so the
numbers do not depend on the layout. ``ndtrain eval --batches training.eval_batches`` reproduces them
from a checkpoint.
"""
from __future__ import annotations

from ndtrain.data import TokenData
from ndtrain.data.eval_sets import prepare_eval_sets


def open_sets(cfg, data: TokenData) -> dict[str, TokenData | None]:
    """``{name: TokenData or None}`` of ``cfg.eval.sets`` (None: the run's own held-out split),
    tokenized with ``data``'s tokenizer. Every rank calls it: the cache is published atomically,
    so ranks racing on a cold cache each get the same folder (the launcher prepares it first).
    Raises ValueError naming the set that failed."""
    if not cfg.eval.named_sets():
        return {}
    return {name: None if folder is None else TokenData(folder, cfg.data.document_mask)
            for name, folder in prepare_eval_sets(cfg, data.tokenizer).items()}


def split_loss(trainer, sampler, data: TokenData, cfg) -> float:
    """Token-weighted loss of ``data``'s ``val`` split over ``eval_batches`` global batches (module
    docstring); this rank's share of each batch is ``sampler.local_slice``. Collective."""
    t, T = cfg.training, cfg.data.seq_len
    dp = trainer.mesh.group("dp")
    n = data.num_sequences("val", T)
    batches = [data.get("val", sampler.local_slice([(b * t.global_batch_size + j) % n
                                                     for j in range(t.global_batch_size)], dp.rank, dp.size), T)
               for b in range(t.eval_batches)]  # (inputs, labels, documents)
    return trainer.eval_loss(batches)


def val_losses(trainer, sampler, data: TokenData, sets: dict, cfg) -> dict[str, float]:
    """``{"val_loss": held-out split, "val_loss/NAME": each set}``; a ``val`` set repeats the
    held-out number without a second pass. Collective."""
    out = {"val_loss": split_loss(trainer, sampler, data, cfg)}
    for name, set_data in sets.items():
        out[f"val_loss/{name}"] = out["val_loss"] if set_data is None else split_loss(trainer, sampler,
                                                                                      set_data, cfg)
    return out
