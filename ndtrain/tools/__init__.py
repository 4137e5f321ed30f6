"""Harnesses shipped with the package: the configuration sweep (``sweep``, ``sweep_groups``; its
table is docs/compatibility.md) and the benchmark helpers (``bench_utils``) the scripts in bench/ use."""
