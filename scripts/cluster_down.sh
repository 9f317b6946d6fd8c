#!/usr/bin/env bash
# Stops what scripts/cluster_up.sh started (same HPT_CLUSTER_DIR), coordinator first so it
# shuts down cleanly while Ray is still there. Data (PostgreSQL, MLflow artifacts) is kept;
# `--purge` deletes the directory as well. `cluster_down.sh NAME...` stops only those
# components (coordinator, ray-coordinator, ray-worker, ray-head, mlflow, postgres).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${HPT_CLUSTER_DIR:-$ROOT/.hpt/cluster}
PURGE=0
NAMES=()
for arg in "$@"; do
  case $arg in
    --purge) PURGE=1 ;;
    coordinator|ray-coordinator|ray-worker|ray-head|mlflow|postgres) NAMES+=("$arg") ;;
    *) echo "cluster_down: unknown argument $arg" >&2; exit 2 ;;
  esac
done
[ ${#NAMES[@]} -gt 0 ] || NAMES=(coordinator ray-coordinator ray-worker ray-head mlflow postgres)
if [ ! -d "$DIR" ]; then echo "cluster_down: nothing at $DIR" >&2; exit 0; fi
# shellcheck disable=SC1091
[ -f "$DIR/state" ] && source "$DIR/state"

# running, session_procs, kill_session, pg_procs, pg_postmaster_alive, pg_clear,
# pg_segment, pg_free_segment
# shellcheck source=cluster_lib.sh
source "$ROOT/scripts/cluster_lib.sh"
stop_group() {  # stop_group NAME GRACE: SIGTERM its session, SIGKILL what is left after GRACE s
  local name=$1 grace=$2 pid
  pid=$(cat "$DIR/pids/$name" 2>/dev/null) || return 0
  if running "$pid"; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 $((grace * 2))); do running "$pid" || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "cluster_down: stopped $name" >&2
  fi
  # the rest of its session, also when the leader was killed before: children in process
  # groups of their own (Ray's workers) or orphaned by a killed leader (mlflow's uvicorn)
  kill_session "$pid"
  rm -f "$DIR/pids/$name"
}
stop_ray_leftovers() {  # Ray daemons that left the session: found by their node's temp dir
  local tmp=$1 pids
  [ -n "$tmp" ] || return 0
  pids=$(pgrep -f -- "$tmp" || true)
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
}

for name in "${NAMES[@]}"; do
  case $name in
    postgres)
      if [ -f "$DIR/pg/PG_VERSION" ]; then
        PG_BIN=${HPT_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
        [ -n "$PG_BIN" ] || PG_BIN=$(dirname "$(command -v pg_ctl)")
        if [ "$(id -u)" = 0 ]; then run=(runuser -u postgres --); else run=(); fi
        segment=$(pg_segment "$DIR/pg")  # a clean stop removes the file and the segment
        if pg_postmaster_alive "$DIR/pg"; then
          "${run[@]}" "$PG_BIN/pg_ctl" -D "$DIR/pg" -m fast -w -t 60 stop >/dev/null ||
            "${run[@]}" "$PG_BIN/pg_ctl" -D "$DIR/pg" -m immediate -w -t 30 stop >/dev/null ||
            true
          echo "cluster_down: stopped postgres" >&2
        fi
        # a killed postmaster's backends (pg_ctl sees no server and stops nothing)
        pg_clear "$DIR/pg" 30 || echo "cluster_down: postgres processes of $DIR/pg survive \
SIGKILL:" $(pg_procs "$DIR/pg") >&2
        # and the shared memory of a killed postmaster (`ipcs -m`: 56 bytes, owner postgres)
        pg_free_segment "$segment"
      fi ;;
    ray-head|ray-worker|ray-coordinator)
      # Ray's daemons keep nothing to flush here (no GCS fault tolerance, results live in the
      # app DB), and a head's raylet and GCS can linger 20 s and more after SIGTERM
      stop_group "$name" "$((PURGE ? 1 : 5))"
      stop_ray_leftovers "${RAY_TMP:+$RAY_TMP/$name}" ;;
    # --purge deletes what a graceful stop would have flushed: a second is enough
    *) stop_group "$name" "$((PURGE ? 1 : 20))" ;;
  esac
done

if [ $PURGE = 1 ]; then
  [ -n "${RAY_TMP:-}" ] && stop_ray_leftovers "$RAY_TMP" && rm -rf "$RAY_TMP"
  rm -rf "$DIR"
  echo "cluster_down: removed $DIR" >&2
fi
