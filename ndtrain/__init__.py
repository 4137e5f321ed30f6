"""ndtrain: N-D parallel transformer training (DP, ZeRO / FSDP, TP / SP, CP, PP, EP on one mesh).

``__version__`` is read from the installed package metadata, whose one source is ``version`` in
``pyproject.toml``; a source tree used without installing reports ``0+unknown``.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ndtrain")
except PackageNotFoundError:  # imported from a checkout that was never pip-installed
    __version__ = "0+unknown"
