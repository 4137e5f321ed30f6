"""lm-evaluation-harness against a run directory: ``NdtrainRunLM(run_dir, checkpoint=None)``, the
harness model ``ndtrain`` (registered when this module is imported; ``model_args="run_dir=D,checkpoint=N"``).

The checkpoint is loaded as ``ndtrain eval`` loads it (``ndtrain.train.rundir.RunDir``: the
single-process model, whatever layout trained it); requests are answered by
``ndtrain.inference.lm_eval_adapter.NdtrainLM``.
"""
from __future__ import annotations

import torch

from ndtrain.inference.lm_eval_adapter import HAVE_LM_EVAL, NdtrainLM
from ndtrain.train.rundir import RunDir


class NdtrainRunLM(NdtrainLM):
    """``NdtrainLM`` of checkpoint ``checkpoint`` (newest when None) of ``run_dir``; ``device``:
    "cpu" / "cuda" (default: cuda when available). The harness's own arguments (``batch_size``,
    ``max_batch_size``) are accepted and unused. Raises ImportError without ``lm_eval``,
    ``RunDirError`` for an unusable run directory or checkpoint."""

    def __init__(self, run_dir: str, checkpoint: int | str | None = None, device: str | None = None,
                 **_harness_args):
        if not HAVE_LM_EVAL:
            raise ImportError("NdtrainRunLM needs lm-evaluation-harness: pip install 'ndtrain[lm-eval]'")
        run = RunDir.open(run_dir)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model, self.step = run.load_model(None if checkpoint in (None, "") else int(checkpoint), dev)
        super().__init__(model, run.tokenizer())


if HAVE_LM_EVAL:
    from lm_eval.api.registry import register_model

    register_model("ndtrain")(NdtrainRunLM)
