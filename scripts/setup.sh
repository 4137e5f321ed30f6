#!/usr/bin/env bash
# Create .venv and install ndtrain with its test dependencies. Safe to re-run.
# torch: the CPU build 2.13.0 when the machine ships its wheel (never pulls a multi-GB CUDA build on
# a CPU machine); on a GPU machine install your CUDA torch first and this keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if ls /opt/wheels/torch-2.13.0* >/dev/null 2>&1; then
    pip install -q --find-links /opt/wheels torch==2.13.0
  else
    pip install -q torch==2.13.0
  fi
fi
pip install -q -e ".[dev]"
python -c "import torch, ndtrain; print(f'ndtrain ready: torch {torch.__version__}')"
