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
    "cpu" / "cuda" (default: cuda when available; cuda without a CUDA device: cpu, said on stderr). The harness's own arguments (``batch_size``,
    ``max_batch_size``) are accepted and unused. Raises ImportError without ``lm_eval``,
    ``RunDirError`` for an unusable run directory or checkpoint."""

    def __init__(self, run_dir: str, checkpoint: int | str | None = None, device: str | None = None,
                 **_harness_args):
        if not HAVE_LM_EVAL:
            raise ImportError("NdtrainRunLM needs lm-evaluation-harness: pip install 'ndtrain[lm-eval]'")
        run = RunDir.open(run_dir)
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            import sys  # the harness's command line passes device=cuda unless told otherwise

            print(f"ndtrain: device {device!r} asked for, but there is no CUDA device: running on cpu",
                  file=sys.stderr)
            device = "cpu"
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model, self.step = run.load_model(None if checkpoint in (None, "") else int(checkpoint), dev)
        super().__init__(model, run.tokenizer())


if HAVE_LM_EVAL:
    from lm_eval.api.registry import register_model

    register_model("ndtrain")(NdtrainRunLM)


def main() -> int:
    """``python -m ndtrain.cli.lm_eval_run ARGS``: the harness's own command line (``lm_eval ARGS``)
    with the model ``ndtrain`` registered, e.g. ``--model ndtrain --model_args run_dir=D --tasks T
    --include_path DIR``. Exit code 2 without ``lm_eval``."""
    if not HAVE_LM_EVAL:
        import sys

        print("ndtrain.cli.lm_eval_run needs lm-evaluation-harness: pip install 'ndtrain[lm-eval]'",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
