#!/usr/bin/env bash
# Sets everything up and runs the main job: a small real sweep on the CPU, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hpt demo "$@"
