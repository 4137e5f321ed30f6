"""lm-evaluation-harness's model interface (``lm_eval.api.model.LM``) over an ndtrain model
(``pip install 'ndtrain[lm-eval]'``).

``NdtrainLM(model, tokenizer)`` wraps a single-process ``Transformer`` and its tokenizer;
``ndtrain.cli.lm_eval_run.NdtrainRunLM(run_dir)`` opens a run directory's checkpoint and registers
the model name ``ndtrain`` with the harness (``model_args="run_dir=D,checkpoint=N"``):

    import lm_eval
    from ndtrain.cli.lm_eval_run import NdtrainRunLM

    lm_eval.simple_evaluate(model=NdtrainRunLM("runs/debug"), tasks=["my_task"],
                            task_manager=lm_eval.tasks.TaskManager(include_path="my_tasks/"))

The three requests are answered with ``ndtrain.inference.tasks``, the code ``ndtrain eval --tasks``
runs, so both give the same numbers request by request: ``loglikelihood`` ->
``tasks.loglikelihood``, ``loglikelihood_rolling`` -> ``tasks.rolling_loglikelihood``,
``generate_until`` -> ``tasks.greedy_until`` (greedy only; sampling arguments raise ValueError).
One request per forward.
"""
from __future__ import annotations

from ndtrain.inference import tasks

try:
    from lm_eval.api.model import LM
except ImportError:  # the optional extra is absent: the class exists, constructing it says why
    LM = None

HAVE_LM_EVAL = LM is not None


class NdtrainLM(LM or object):
    """``lm_eval.api.model.LM`` for ``model`` (a single-process ``Transformer``, eval mode) and
    ``tokenizer`` (its ``ndtrain.data.tokenizer.Tokenizer``). Raises ImportError without ``lm_eval``."""

    def __init__(self, model, tokenizer):
        if not HAVE_LM_EVAL:
            raise ImportError("NdtrainLM needs lm-evaluation-harness: pip install 'ndtrain[lm-eval]'")
        super().__init__()
        self.model, self.tok = model.eval(), tokenizer

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request ``(context, continuation)``."""
        return [tasks.loglikelihood(self.model, self.tok, *req.args) for req in requests]

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log p(string) after EOS per request ``(string,)``, every token scored once."""
        return [tasks.rolling_loglikelihood(self.model, self.tok, req.args[0]) for req in requests]

    def generate_until(self, requests) -> list[str]:
        """Greedy text per request ``(context, gen_kwargs)``: ``until`` (str or list) stops it,
        ``max_gen_toks`` bounds it (default ``tasks.DEFAULT_MAX_NEW_TOKENS``)."""
        out = []
        for req in requests:
            context, kw = req.args[0], dict(req.args[1] or {})
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError(f"NdtrainLM generates greedily; got sampling arguments {kw}")
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            out.append(tasks.greedy_until(self.model, self.tok, context, until,
                                          int(kw.get("max_gen_toks", tasks.DEFAULT_MAX_NEW_TOKENS))))
        return out
