"""Release 0.2's module paths keep importing, for one release, as the modules at their new paths
(the same objects), each with a DeprecationWarning that names the new path."""
import importlib
import sys
import warnings

import pytest

import ndtrain


@pytest.mark.parametrize("old", sorted(ndtrain._MOVED))
def test_old_module_path_is_the_new_module(old):
    sys.modules.pop(f"ndtrain.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(f"ndtrain.{old}")
    new = f"ndtrain.{ndtrain._MOVED[old]}"
    assert mod is importlib.import_module(new) and mod.__spec__.name == new  # its own spec kept
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_old_names_of_modules_that_became_packages():
    from ndtrain.checkpoint.dcp import latest_checkpoint
    from ndtrain.train.loop import run

    with pytest.warns(DeprecationWarning, match="ndtrain.checkpoint.dcp.latest_checkpoint"):
        from ndtrain.checkpoint import latest_checkpoint as old_latest
    with pytest.warns(DeprecationWarning, match="ndtrain.train.loop.run"):
        from ndtrain.train import run as old_run
    assert old_latest is latest_checkpoint and old_run is run
    with pytest.raises(ImportError, match="no_such_name"):
        from ndtrain.train import no_such_name  # noqa: F401


def test_the_console_script_and_python_dash_m():
    """The console script ``ndtrain.cli:main`` stays a function whatever was imported before (a
    submodule named ``main`` would shadow it once imported)."""
    import ndtrain.cli.commands  # noqa: F401  (importing every submodule first)
    from ndtrain.cli import main

    assert callable(main) and main.__module__ == "ndtrain.cli"
    assert importlib.util.find_spec("ndtrain.cli.__main__") is not None
