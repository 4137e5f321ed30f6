"""ndtrain: N-D parallel transformer training (DP, ZeRO / FSDP, TP / SP, CP, PP, EP on one mesh).

``__version__`` is read from the installed package metadata, whose one source is ``version`` in
``pyproject.toml``; a source tree used without installing reports ``0+unknown``.

Module paths of release 0.2 (``ndtrain.trainer``, ``ndtrain.hf_common``, ...) still import, with a
DeprecationWarning naming the new path, until the next release (``_MOVED`` below).
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ndtrain")
except PackageNotFoundError:  # imported from a checkout that was never pip-installed
    __version__ = "0+unknown"

# Old module path (0.2) -> new one. Paths that became packages (config, train, checkpoint, hf, cli)
# forward their old names from the package itself.
_MOVED = {
    "cli_after": "cli.after", "launch": "cli.launch", "preflight": "cli.preflight",
    "rerun": "cli.rerun", "convert": "cli.convert", "planner.cli": "cli.plan",
    "config_schema": "config.schema", "config_keys": "config.keys", "validate": "config.validate",
    "trainer": "train.trainer", "train_extras": "train.extras", "metrics": "train.metrics",
    "profiling": "train.profiling", "console": "train.console",
    "rundir": "train.rundir", "fault.integrity": "checkpoint.integrity", "fault.events": "events",
    "hf_common": "hf.common", "hf_mamba2": "hf.mamba2", "hf_moe": "hf.moe", "hf_moe_export": "hf.moe",
    "hf_qwen3_moe": "hf.qwen3_moe", "hf_qwen3_next": "hf.qwen3_next",
    "generate": "inference.generate", "evaluate": "inference.evaluate",
    "sweep": "tools.sweep", "sweep_groups": "tools.sweep_groups", "bench_utils": "tools.bench_utils",
    "planner.eager_axes": "calibration.eager_axes", "planner.eager_axes_time": "calibration.eager_axes_time",
    "planner.eager_time": "calibration.eager_time", "planner.measure": "calibration.measure",
    "planner.measure_eager": "calibration.measure_eager", "planner.measure_ep": "calibration.measure_ep",
    "planner.calibrate": "calibration.calibrate", "ops.select": "model.kernels",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``ndtrain.<old>`` as the module at its new path (the same module object)."""

    specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("ndtrain.")
        if fullname.startswith("ndtrain.") and old in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = "ndtrain." + _MOVED[spec.name.removeprefix("ndtrain.")]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        self.specs[new] = module.__spec__  # import machinery stamps the old name's spec on it next
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs[module.__name__]  # the new module already ran: only undo the stamp
        module.__loader__ = module.__spec__.loader


def _forward(package: str, target: str, names: set[str]):
    """A module ``__getattr__`` that forwards ``names`` of a 0.2 module to ``target`` (deprecated)."""
    def __getattr__(name):
        if name in names:
            warnings.warn(f"{package}.{name} moved to {target}.{name}; the old path goes in the next "
                          "release", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(target), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


sys.meta_path.append(_MovedModuleFinder())
