#!/usr/bin/env bash
# Starts the local PostgreSQL 15 cluster and creates the test role and database if missing.
# Idempotent; prints the URL to export as HPT_TEST_POSTGRES_URL. Needs root (or the postgres user).
set -euo pipefail

ROLE=${HPT_PG_ROLE:-hpt}
PASSWORD=${HPT_PG_PASSWORD:-hpt}
DB=${HPT_PG_DB:-hpt_test}
PORT=${HPT_PG_PORT:-5432}
VERSION=${HPT_PG_VERSION:-15}
CLUSTER=${HPT_PG_CLUSTER:-main}

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  # a fresh machine without the server: Debian's package (root only)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2
fi

as_postgres() {
  if [ "$(id -un)" = postgres ]; then "$@"; else su postgres -c "$(printf '%q ' "$@")"; fi
}

if ! pg_lsclusters -h 2>/dev/null | awk -v v="$VERSION" -v c="$CLUSTER" \
    '$1 == v && $2 == c && $4 == "online" {found=1} END {exit !found}'; then
  pg_ctlcluster "$VERSION" "$CLUSTER" start
fi

# Wait for the server to accept connections (start returns before that on slow machines).
for _ in $(seq 1 30); do
  if as_postgres pg_isready -q -h 127.0.0.1 -p "$PORT"; then break; fi
  sleep 1
done
as_postgres pg_isready -q -h 127.0.0.1 -p "$PORT"

role_exists=$(as_postgres psql -p "$PORT" -tAc "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")
if [ "$role_exists" != 1 ]; then
  # SUPERUSER so tests may create a schema or database per run.
  as_postgres psql -p "$PORT" -q -c "CREATE ROLE $ROLE LOGIN PASSWORD '$PASSWORD' SUPERUSER"
fi
db_exists=$(as_postgres psql -p "$PORT" -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'")
if [ "$db_exists" != 1 ]; then
  as_postgres createdb -p "$PORT" -O "$ROLE" "$DB"
fi

echo "postgresql://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB"
