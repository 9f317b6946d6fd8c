#!/usr/bin/env bash
# The production topology of docker-compose.yml as separate local processes, on free ports,
# under one directory (default .hpt/cluster, or $HPT_CLUSTER_DIR):
#   postgres    its own PostgreSQL instance (initdb), databases hpt, optuna and mlflow
#   mlflow      `mlflow server` on that PostgreSQL, proxied artifacts (--artifacts-destination)
#   ray-head    `ray start --head`
#   ray-worker  `ray start --address=HEAD` with its own resource label (hpt_worker)
#   coordinator `ray start --address=HEAD --num-cpus=0` + `hpt serve` with a token
# Idempotent: a component already running is left alone, a stopped one is started again with
# the same ports, password and token. `source DIR/env` gives a shell the coordinator's
# settings (hpt status, hpt doctor, the Python client). Stop it all: scripts/cluster_down.sh.
# `--without mlflow` leaves the MLflow server as it is (down for maintenance: the coordinator
# keeps every result and mirrors it when the server is back).
set -euo pipefail
WITHOUT_MLFLOW=0
while [ $# -gt 0 ]; do
  case $1 in
    --without)
      [ "${2:-}" = mlflow ] || { echo "cluster_up: --without takes mlflow" >&2; exit 2; }
      WITHOUT_MLFLOW=1; shift 2 ;;
    *) echo "cluster_up: unknown argument $1 (known: --without mlflow)" >&2; exit 2 ;;
  esac
done
unset WAIT_UNTIL  # wait_for's per-call deadline: never inherited from the environment
# The daemons started below must not inherit the caller's descriptors (a `flock` held around
# this script would otherwise stay held by PostgreSQL for as long as it runs).
for fd in /proc/$$/fd/*; do
  fd=${fd##*/}
  if [ "$fd" -gt 2 ] && [ "$fd" != 255 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${HPT_CLUSTER_DIR:-$ROOT/.hpt/cluster}
HEAD_CPUS=${HPT_HEAD_CPUS:-1}
WORKER_CPUS=${HPT_WORKER_CPUS:-1}
OBJECT_STORE_BYTES=${HPT_RAY_OBJECT_STORE_BYTES:-200000000}  # small: 2 cores, 3 raylets
MLFLOW_WORKERS=${HPT_MLFLOW_WORKERS:-1}
# 0: the Ray head without its dashboard (a web UI, and a dozen Python processes on the head
# that nothing here uses: tests turn it off)
RAY_DASHBOARD=${HPT_RAY_DASHBOARD:-1}
TIMEOUT=${HPT_CLUSTER_TIMEOUT:-180}

die() { echo "cluster_up: error: $*" >&2; exit 1; }
say() { echo "cluster_up: $*" >&2; }

# ---------------------------------------------------------------- programs
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY=$ROOT/.venv/bin/python
else
  say "no .venv yet: running scripts/setup.sh"
  bash "$ROOT/scripts/setup.sh"
  PY=$ROOT/.venv/bin/python
fi
BIN=$(dirname "$PY")
for prog in ray mlflow hpt; do
  [ -x "$BIN/$prog" ] || die "$BIN/$prog not found: install the package (scripts/setup.sh)"
done
PG_BIN=${HPT_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
if [ -z "$PG_BIN" ] && command -v initdb >/dev/null 2>&1; then PG_BIN=$(dirname "$(command -v initdb)"); fi
[ -n "$PG_BIN" ] && [ -x "$PG_BIN/initdb" ] || die "PostgreSQL server programs (initdb, pg_ctl) \
not found: install PostgreSQL 15 (apt-get install postgresql) or set HPT_PG_BIN"

mkdir -p "$DIR/logs" "$DIR/pids" "$DIR/mlartifacts" "$DIR/hpt/data"
DIR=$(cd "$DIR" && pwd)

# ---------------------------------------------------------------- state: ports and secrets
# Chosen once and kept, so a restarted component comes back where the others expect it.
# all at once (hptransfer.sockets.free_ports): ports asked for one by one can repeat
free_ports() { "$PY" -c 'import sys; from hptransfer.sockets import free_ports
print(*free_ports(int(sys.argv[1])))' "$1"; }
secret() { "$PY" -c 'import secrets; print(secrets.token_urlsafe(24))'; }
# every value shell-quoted (printf %q): these files are sourced, and a chosen token or a
# clone path may hold spaces or $(...)
keep() { printf '%s=%q\n' "$1" "$2"; }
if [ ! -f "$DIR/state" ]; then
  umask 077
  names=(PG_PORT MLFLOW_PORT RAY_PORT RAY_DASHBOARD_PORT RAY_CLIENT_PORT
         RAY_AGENT_PORT_HEAD RAY_AGENT_PORT_WORKER RAY_AGENT_PORT_COORD API_PORT)
  ports=$(free_ports "${#names[@]}") || die "cannot pick free ports with $PY"
  read -r -a ports <<< "$ports"
  {
    for i in "${!names[@]}"; do keep "${names[$i]}" "${ports[$i]}"; done
    keep PG_PASSWORD "$(secret)"
    keep API_TOKEN "${HPT_API_TOKEN:-$(secret)}"
    keep RAY_TOKEN "$("$PY" -c 'import secrets; print(secrets.token_hex(32))')"
    # short: Ray's unix socket paths under it are limited to 107 characters
    keep RAY_TMP "$(mktemp -d /tmp/hptray.XXXXXX)"
  } > "$DIR/state.tmp"
  mv "$DIR/state.tmp" "$DIR/state"
  umask 022
fi
# shellcheck disable=SC1091
source "$DIR/state"
mkdir -p "$RAY_TMP"

PG_URL=postgresql://hpt:$PG_PASSWORD@127.0.0.1:$PG_PORT
RAY_ADDRESS_=127.0.0.1:$RAY_PORT
umask 077
{
  echo "# the coordinator's settings: source this file to use the local cluster from a shell"
  printf 'export HPT_HOME=%q\n' "$DIR/hpt"
  printf 'export HPT_DATABASE_URL=%q\n' "$PG_URL/hpt"
  printf 'export HPT_OPTUNA_URL=%q\n' "$PG_URL/optuna"
  printf 'export MLFLOW_TRACKING_URI=%q\n' "http://127.0.0.1:$MLFLOW_PORT"
  printf 'export RAY_ADDRESS=%q\n' "$RAY_ADDRESS_"
  printf 'export HPT_API_TOKEN=%q\n' "$API_TOKEN"
  printf 'export HPT_URL=%q\n' "http://127.0.0.1:$API_PORT"
  printf 'export RAY_AUTH_MODE=%q\n' token
  printf 'export RAY_AUTH_TOKEN=%q\n' "$RAY_TOKEN"
  printf 'export HPT_RAY_REQUIRE=%q\n' hpt_worker
} > "$DIR/env"
umask 022

# ---------------------------------------------------------------- process helpers
# running, session_procs, kill_session, pg_procs, pg_postmaster_alive, pg_clear
# shellcheck source=cluster_lib.sh
source "$ROOT/scripts/cluster_lib.sh"
alive() {  # alive NAME: its recorded process (group leader) runs
  local pid
  pid=$(cat "$DIR/pids/$1" 2>/dev/null) || return 1
  running "$pid"
}
start_bg() {  # start_bg NAME CMD...: in a session of its own, so cluster_down stops it whole
  local name=$1 old; shift
  # a killed leader's children are still in its session (and may hold its port)
  old=$(cat "$DIR/pids/$name" 2>/dev/null) && kill_session "$old"
  setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! > "$DIR/pids/$name"
}
wait_for() {  # wait_for NAME DESCRIPTION CHECK...: poll CHECK until it succeeds, for TIMEOUT s
  local name=$1 what=$2; shift 2  # (or until WAIT_UNTIL, in $SECONDS, when a caller sets it)
  local deadline=${WAIT_UNTIL:-$((SECONDS + TIMEOUT))}
  until "$@" >/dev/null 2>&1; do
    if [ -f "$DIR/pids/$name" ] && ! alive "$name"; then
      tail -n 30 "$DIR/logs/$name.log" >&2 || true
      die "$name exited before $what (log: $DIR/logs/$name.log)"
    fi
    [ $SECONDS -lt $deadline ] || { tail -n 30 "$DIR/logs/$name.log" >&2 || true
      die "$name: no $what after ${TIMEOUT}s (log: $DIR/logs/$name.log)"; }
    sleep 0.2  # the checks are cheap (grep, curl): a ready component is seen at once
  done
}
clear_node() {  # clear_node NAME: what a killed Ray node left behind (found by its temp dir)
  local pids
  pids=$(pgrep -f -- "$RAY_TMP/$1/" || true)
  [ -z "$pids" ] || { say "clearing leftovers of $1"; kill -KILL $pids 2>/dev/null || true; }
}
http_ok() {  # an answer with a 2xx status (curl where there is one: no Python start per poll)
  if command -v curl >/dev/null 2>&1; then
    curl -fsS -o /dev/null --max-time 5 "$1"
  else
    "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1"
  fi
}
log_has() { grep -q "$2" "$DIR/logs/$1.log"; }

# ---------------------------------------------------------------- PostgreSQL
# PostgreSQL refuses to run as root: as root the instance belongs to the postgres user.
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || die "running as root needs the 'postgres' system user"
  as_pg() { runuser -u postgres -- "$@"; }
else
  as_pg() { "$@"; }
fi
PGDATA=$DIR/pg
if [ ! -f "$PGDATA/PG_VERSION" ]; then
  say "initialising PostgreSQL in $PGDATA"
  mkdir -p "$PGDATA"
  chmod 700 "$PGDATA"
  [ "$(id -u)" = 0 ] && chown postgres "$PGDATA"
  as_pg test -w "$PGDATA" || die "the postgres user cannot write $PGDATA: pick an \
HPT_CLUSTER_DIR whose parents it can enter (not a mode-700 folder of root)"
  pwfile=$(mktemp)  # mode 600: the password is readable by its owner alone
  echo "$PG_PASSWORD" > "$pwfile"
  [ "$(id -u)" = 0 ] && chown postgres "$pwfile"  # initdb runs as postgres
  as_pg "$PG_BIN/initdb" -D "$PGDATA" -U hpt --pwfile="$pwfile" --auth=scram-sha-256 \
    -E UTF8 >"$DIR/logs/postgres-init.log" 2>&1 || { rm -f "$pwfile"
    die "initdb failed (log: $DIR/logs/postgres-init.log)"; }
  rm -f "$pwfile"
fi
if pg_postmaster_alive "$PGDATA"; then
  say "postgres already running"
else
  # a killed postmaster leaves its pid file (naming a zombie until its parent reaps it, and
  # PostgreSQL refuses to start while kill -0 finds that pid) and, maybe, backends that
  # keep its shared memory: clear both, the pid file only once nothing of the data dir runs
  pg_clear "$PGDATA" "$TIMEOUT" || die "postgres: processes of the dead server in $PGDATA \
still run after ${TIMEOUT}s (pids $(pg_procs "$PGDATA" | tr '\n' ' ')): stop them, then run \
this again"
  if [ -f "$PGDATA/postmaster.pid" ]; then
    say "postgres: removing the stale postmaster.pid (postmaster $(head -n 1 \
"$PGDATA/postmaster.pid") is gone)"
    rm -f "$PGDATA/postmaster.pid"
  fi
  touch "$DIR/logs/postgres.log"
  [ "$(id -u)" = 0 ] && chown postgres "$DIR/logs/postgres.log"
  # TCP on loopback only, no unix socket (its path length is limited)
  as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$DIR/logs/postgres.log" -w -t "$TIMEOUT" \
    -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=''" start \
    >/dev/null || { tail -n 20 "$DIR/logs/postgres.log" >&2; die "PostgreSQL did not start"; }
fi
wait_for postgres "connections" "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"
for db in hpt optuna mlflow; do  # separate databases: all three use an alembic_version table
  exists=$(PGPASSWORD=$PG_PASSWORD "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U hpt -d postgres \
    -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")
  [ "$exists" = 1 ] || PGPASSWORD=$PG_PASSWORD "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" \
    -U hpt "$db"
done

# ---------------------------------------------------------------- MLflow server
if [ $WITHOUT_MLFLOW = 1 ]; then
  say "mlflow left as it is (--without mlflow)"
elif alive mlflow; then
  say "mlflow already running"
else
  # without MLflow's GenAI job runner (SERVER_ENV in hptransfer/tracking/tracking.py)
  start_bg mlflow env MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$BIN/mlflow" server \
    --backend-store-uri "postgresql+psycopg://hpt:$PG_PASSWORD@127.0.0.1:$PG_PORT/mlflow" \
    --artifacts-destination "$DIR/mlartifacts" --host 127.0.0.1 --port "$MLFLOW_PORT" \
    --workers "$MLFLOW_WORKERS" --allowed-hosts "127.0.0.1:$MLFLOW_PORT,localhost:$MLFLOW_PORT"
fi

# ---------------------------------------------------------------- Ray head and worker
# Each node its own temp dir (under RAY_TMP, so cluster_down finds every process of it) and
# its own agent port; the worker is told apart by its resource label, as a GPU host would be.
# Token authentication with this cluster's own token; every node on loopback only.
unset RAY_ADDRESS
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$RAY_TOKEN
case $RAY_DASHBOARD in
  1) RAY_DASHBOARD=true ;;
  0) RAY_DASHBOARD=false ;;
  *) die "HPT_RAY_DASHBOARD is 1 (the Ray dashboard, the default) or 0 (none), not $RAY_DASHBOARD" ;;
esac
if alive ray-head; then
  say "ray-head already running"
else
  clear_node ray-head
  start_bg ray-head "$BIN/ray" start --head --node-ip-address=127.0.0.1 --port="$RAY_PORT" \
    --num-cpus="$HEAD_CPUS" --include-dashboard="$RAY_DASHBOARD" \
    --num-gpus=0 --dashboard-host=127.0.0.1 --dashboard-port="$RAY_DASHBOARD_PORT" \
    --ray-client-server-port="$RAY_CLIENT_PORT" \
    --dashboard-agent-listen-port="$RAY_AGENT_PORT_HEAD" \
    --object-store-memory="$OBJECT_STORE_BYTES" --temp-dir="$RAY_TMP/ray-head" \
    --disable-usage-stats --block
fi
wait_for ray-head "a running Ray head" log_has ray-head "Ray runtime started"

join_ray() {  # join_ray NAME AGENT_PORT ARGS...: start a Ray node, wait until it joined
  local name=$1 agent=$2; shift 2
  if alive "$name"; then say "$name already running"; return; fi
  local attempt deadline
  for attempt in 1 2; do
    clear_node "$name"
    start_bg "$name" "$BIN/ray" start --address="$RAY_ADDRESS_" --node-ip-address=127.0.0.1 \
      --dashboard-agent-listen-port="$agent" --object-store-memory="$OBJECT_STORE_BYTES" \
      --temp-dir="$RAY_TMP/$name" --disable-usage-stats --block "$@"
    deadline=$((SECONDS + TIMEOUT))
    while alive "$name" && ! log_has "$name" "Ray runtime started" && [ $SECONDS -lt $deadline ]
    do sleep 0.2; done
    # Ray gives a new raylet a fixed 30 s to register with the GCS, and the node exits when
    # it misses that; a loaded host can make it miss, so such a node starts once more
    if [ "$attempt" = 1 ] && ! alive "$name" && log_has "$name" "timed out during startup"
    then
      say "$name did not register with the head within Ray's 30 s; starting it again"
      mv "$DIR/logs/$name.log" "$DIR/logs/$name.1.log"
      continue
    fi
    break
  done
  # what is left of the last attempt's TIMEOUT: a node that hangs is not waited for twice
  WAIT_UNTIL=$deadline wait_for "$name" "a Ray node joined to the head" \
    log_has "$name" "Ray runtime started"
}
# both nodes at once (each in a subshell of its own: a failure says so and ends that one)
join_ray ray-worker "$RAY_AGENT_PORT_WORKER" --num-cpus="$WORKER_CPUS" \
  --resources='{"hpt_worker": 1}' &
worker_join=$!
# the coordinator's own raylet: no CPUs, so no trial lands beside the API
join_ray ray-coordinator "$RAY_AGENT_PORT_COORD" --num-cpus=0 --num-gpus=0 &
coordinator_join=$!
joined=0
wait "$worker_join" || joined=1
wait "$coordinator_join" || joined=1
[ $joined = 0 ] || exit 1
[ $WITHOUT_MLFLOW = 1 ] ||
  wait_for mlflow "an answer on /health" http_ok "http://127.0.0.1:$MLFLOW_PORT/health"

# ---------------------------------------------------------------- coordinator
if alive coordinator; then
  say "coordinator already running"
else
  old=$(cat "$DIR/pids/coordinator" 2>/dev/null) && kill_session "$old"
  # shellcheck disable=SC1091
  (source "$DIR/env" && exec setsid "$BIN/hpt" serve --host 127.0.0.1 --port "$API_PORT") \
    >>"$DIR/logs/coordinator.log" 2>&1 </dev/null &
  echo $! > "$DIR/pids/coordinator"
fi
wait_for coordinator "an answer on /health" http_ok "http://127.0.0.1:$API_PORT/health"

cat <<EOF
hptransfer local cluster up in $DIR
  API (token in $DIR/env)   http://127.0.0.1:$API_PORT   (/docs, /dashboards, /health)
  MLflow server             http://127.0.0.1:$MLFLOW_PORT
  Ray dashboard             $([ "$RAY_DASHBOARD" = true ] && echo "http://127.0.0.1:$RAY_DASHBOARD_PORT" || echo "off (HPT_RAY_DASHBOARD=0)")   (head 127.0.0.1:$RAY_PORT)
  PostgreSQL                postgresql://hpt:***@127.0.0.1:$PG_PORT/{hpt,optuna,mlflow}
  logs                      $DIR/logs/
use it:   source $DIR/env && hpt doctor && hpt submit examples/cpu_small.yaml --wait
stop it:  bash scripts/cluster_down.sh
EOF
