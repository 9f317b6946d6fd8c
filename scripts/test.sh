#!/usr/bin/env bash
# Sets everything up (venv, PostgreSQL for the store tests) and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A real PostgreSQL for the store tests; skipped (and said so) only where none can be started.
if url=$(bash scripts/postgres_up.sh 2>/tmp/hpt-postgres.log | tail -n 1) && [ -n "$url" ]; then
  export HPT_TEST_POSTGRES_URL="$url"
elif [ "${CI:-}" = true ]; then
  echo "error: PostgreSQL could not be started in CI:" >&2; cat /tmp/hpt-postgres.log >&2; exit 1
else
  echo "warning: PostgreSQL could not be started (see /tmp/hpt-postgres.log); PG tests skip" >&2
fi
# headless Chromium for the dashboard tests (Debian package; they skip, saying why, without it)
bash scripts/install_chromium.sh || echo "warning: chromium could not be installed" >&2
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
