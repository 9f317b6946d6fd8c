#!/usr/bin/env bash
# Sets everything up (venv, PostgreSQL for the store tests) and runs the test suite.
# Strict mode (HPT_TEST_STRICT=1, set by .ci/run; CI=true implies it): a PostgreSQL or Chromium
# that cannot be had fails the run, and tests/conftest.py turns every skip into a failure.
# Elsewhere those tests skip, and pytest's summary (-rs) says why.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${CI:-}" = true ]; then
  export HPT_TEST_STRICT=1
fi
strict=${HPT_TEST_STRICT:-0}
bash scripts/setup.sh
# A real PostgreSQL for the store tests.
if url=$(bash scripts/postgres_up.sh 2>/tmp/hpt-postgres.log | tail -n 1) && [ -n "$url" ]; then
  export HPT_TEST_POSTGRES_URL="$url"
elif [ "$strict" = 1 ]; then
  echo "error: PostgreSQL could not be started (strict mode):" >&2
  cat /tmp/hpt-postgres.log >&2
  exit 1
else
  echo "warning: PostgreSQL could not be started (see /tmp/hpt-postgres.log); PG tests skip" >&2
fi
# headless Chromium for the dashboard browser tests
if ! bash scripts/install_chromium.sh; then
  if [ "$strict" = 1 ]; then
    echo "error: Chromium could not be installed (strict mode); see the lines above" >&2
    exit 1
  fi
  echo "warning: Chromium could not be installed; the browser tests skip" >&2
fi
.venv/bin/ruff check .
# --durations: the slowest tests in every log (the suite must stay under 15 minutes on 2 cores).
# Two workers (HPT_TEST_WORKERS; 0: one process, which keeps 2 cores only ~40 % busy), a whole
# file to each at a time. pytest-randomly shuffles the files and the tests in each on every run,
# so an order dependence shows; tests/conftest.py then puts the slow files first. The seed is
# printed first: HPT_TEST_SEED=N replays that order.
workers=${HPT_TEST_WORKERS:-2}
seed=${HPT_TEST_SEED:-$((RANDOM * 32768 + RANDOM))}
echo "test order: --randomly-seed=$seed (HPT_TEST_SEED=$seed replays it)"
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider --durations=60 \
  -n "$workers" --dist loadfile --no-loadscope-reorder --randomly-seed="$seed" "$@"
