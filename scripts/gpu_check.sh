#!/usr/bin/env bash
# Run ON the GPU machine, as one device call from the repository root:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# after scripts/gpu_wheels.sh here. Installs the carried wheels into /tmp/site, then runs
# benchmarks/gpu_check.py with the image's own torch. Every line is flushed and copied to
# $OUT/gpu_check.log, so a run cut short still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  python3 benchmarks/gpu_check.py "$@"
} 2>&1 | tee "$OUT/gpu_check.log"
