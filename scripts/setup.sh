#!/usr/bin/env bash
# Creates .venv and installs hptransfer with its dependencies. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  # none yet, or half made (interrupted while it installed pip): made again from scratch
  "$PY" -m venv --clear .venv
  rm -f .venv/.hpt-installed
fi
stamp=.venv/.hpt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  quiet() { "$@" 2> >(grep -v "is ignored" >&2); }  # drop pip's local-index noise
  quiet .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned to a CPU-capable release in the declared range, so pip does not pull
  # a multi-GB CUDA build when only the range is given; GPU hosts can preinstall their own.
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    quiet .venv/bin/python -m pip install -q "torch==2.13.0" ||
      quiet .venv/bin/python -m pip install -q "torch>=2.4,<2.14"
  fi
  quiet .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
