"""One training run: the loop with its phases (``loop.run``), one rank's state and step
(``trainer.Trainer``), the auxiliary losses (``extras``), metrics and MFU (``metrics``), memory
accounting (``mem_account``), the profiler window (``profiling``), rank 0's console (``console``) and
the run directory's files (``rundir``)."""
from ndtrain import _forward

__getattr__ = _forward("ndtrain.train", "ndtrain.train.loop", {"run", "Trainer", "IGNORE_INDEX"})
