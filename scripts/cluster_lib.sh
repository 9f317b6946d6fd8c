# Process helpers shared by cluster_up.sh and cluster_down.sh (sourced, not run).

running() {  # running PID: exists and is not a zombie (a killed, not yet reaped, process)
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

session_procs() {  # session_procs SID: the live processes of that session, its leader aside
  ps -eo pid=,sid=,stat= | awk -v s="$1" '$2 == s && $1 != s && $3 !~ /^Z/ {print $1}'
}

kill_session() {  # kill_session SID: SIGKILL what is left of a session whose leader is gone
  local left                      # (a child the leader started, e.g. mlflow's uvicorn, which
  left=$(session_procs "$1")      # would keep holding the port)
  [ -z "$left" ] || kill -KILL $left 2>/dev/null || true
}

pg_procs() {  # pg_procs PGDATA: the live processes of that data dir's PostgreSQL
  # PostgreSQL chdirs into its data dir and every backend inherits that; their command lines
  # are rewritten ("postgres: hpt hpt 127.0.0.1(5432) SELECT"), so they cannot tell
  local dir pattern link pid
  dir=$(cd "$1" 2>/dev/null && pwd -P) || return 0
  pattern=$(printf '%s' "$dir" | sed 's/[][*?\\]/\\&/g')  # find -lname takes a glob
  for link in $(find /proc -mindepth 2 -maxdepth 2 -name cwd -lname "$pattern" 2>/dev/null); do
    pid=${link#/proc/}
    pid=${pid%/cwd}
    case $(readlink "/proc/$pid/exe" 2>/dev/null) in
      */postgres) if running "$pid"; then echo "$pid"; fi ;;
    esac
  done
  return 0
}

pg_postmaster_alive() {  # pg_postmaster_alive PGDATA: its pid file names a live postmaster of it
  # (not `pg_ctl status`: a killed postmaster that its parent has not reaped yet is a zombie,
  # and kill -0, which pg_ctl and PostgreSQL itself rely on, still finds it)
  local pid live
  pid=$(head -n 1 "$1/postmaster.pid" 2>/dev/null) || return 1
  live=$(pg_procs "$1")  # not piped into grep -q: under pipefail its early exit fails it
  [ -n "$pid" ] && case " $(echo $live) " in *" $pid "*) true ;; *) false ;; esac
}

pg_clear() {  # pg_clear PGDATA SECONDS: SIGKILL what a dead postmaster left running there
  # Backends busy in a query outlive a postmaster's kill -9 (they notice it only when they
  # next wait) and stay attached to its shared memory: PostgreSQL will not start beside
  # them ("pre-existing shared memory block is still in use"). Nothing of them is worth
  # keeping: the new postmaster's crash recovery replays the WAL. 1 if some outlive SECONDS.
  local left deadline=$((SECONDS + $2))
  left=$(pg_procs "$1")
  [ -n "$left" ] || return 0
  echo "postgres: its postmaster is gone; killing what it left running in $1:" $left >&2
  while [ -n "$left" ]; do
    kill -KILL $left 2>/dev/null || true
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
    left=$(pg_procs "$1")
  done
}

pg_segment() {  # pg_segment PGDATA: "KEY SHMID" of its server's System V segment, if recorded
  sed -n 7p "$1/postmaster.pid" 2>/dev/null || true
}

pg_free_segment() {  # pg_free_segment "KEY SHMID": remove a dead server's segment
  # PostgreSQL removes its small System V segment (a 56-byte header, the interlock that keeps
  # a second server off the data dir) when it stops, and a new server on the same data dir
  # recycles a dead one's; a postmaster killed -9 and never started again leaves it for
  # good (nothing else removes it once the data dir is deleted). Only that segment (its key
  # and id both as postmaster.pid recorded them), and only with nothing attached.
  local key shmid
  read -r key shmid <<<"$1" || true
  [ -n "${shmid:-}" ] || return 0
  if awk -v k="$key" -v id="$shmid" 'NR > 1 && $1 == k && $2 == id && $7 == 0 {f = 1}
      END {exit !f}' /proc/sysvipc/shm 2>/dev/null; then
    ipcrm -m "$shmid" 2>/dev/null || true
  fi
}
