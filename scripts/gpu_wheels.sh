#!/usr/bin/env bash
# Run HERE (a machine with package registries) before a GPU check: downloads into .whl/ the
# wheels that benchmarks/gpu_check.py needs and the GPU machine's image lacks (it has torch,
# numpy, tokenizers and tqdm; not pydantic, and typing_extensions may be older than it needs). .whl/ is git-ignored, so it
# travels only when the device call names it in `carry` (see scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"  # the GPU image's python3
rm -rf .whl && mkdir -p .whl
pin() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$(pin "$name")"
done
ls -l .whl
