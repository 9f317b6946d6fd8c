"""A chaos storm over the whole local deployment (issue 52): random kill -9s during one sweep.

`scripts/cluster_up.sh` brings up its topology as processes (PostgreSQL, `mlflow server`, a
Ray head, a Ray worker node, the coordinator's raylet and `hpt serve`) in a scratch folder.
One sweep of small CPU trials goes in over REST, and while it runs `--faults` faults are
injected, one kind drawn at random (`--seed`) each time, the first four one of each kind:

* coordinator: kill -9 of `hpt serve`;
* ray-worker:  kill -9 of the Ray worker node's whole session (its `ray start`, raylet,
  agents and the trials' workers), as when that host dies;
* mlflow:      kill -9 of the `mlflow server` process (its uvicorn child is left running,
  holding the port, as after an OOM kill of the parent);
* postgres:    kill -9 of PostgreSQL's postmaster (its backends are left to notice).

Each fault is followed at once by `cluster_up.sh`, which must bring the component back on
its own. Fault i waits until i / (faults + 1) of the sweep completed (so the faults spread
over it) and a trial more than at the last fault (so each lands on a sweep that makes
progress), plus a random moment. A sweep that ends while events are left (its trials trained
faster than the restores took) is followed by another with seeds of its own, of a trial per
event left and one more (whole seeds of the LR grid), each event then after a trial more of it.
At the end it checks, for every sweep and with no manual step in between: the sweep and
every trial completed, each trial exactly once (one completed attempt; `attempts` equals its
attempt rows); exactly one FINISHED MLflow run per trial on the MLflow server (read with
mlflow's client), the sweep's own run FINISHED and no run left RUNNING; and no process of the
deployment left after `cluster_down.sh`. It prints one summary line and exits 1 when a check
failed.

`--mlflow-down-second-half`: the MLflow server is stopped once half the trials completed
and stays down until the sweep has ended (`cluster_up.sh --without mlflow` restores the
rest; an MLflow fault drawn then becomes another kind); the results must be kept (attempts
wait for the mirror) and mirrored when it is back.

`--pg-restarts-mid-write N`: N more events, each an immediate restart of PostgreSQL (SIGQUIT
to the postmaster, what `pg_ctl stop -m immediate` sends, then `cluster_up.sh` starts it)
fired the moment the coordinator has a transaction open that wrote and has not committed
(a backend of its database with an XID, in `pg_stat_activity`, polled every few ms once the
sweep reached the event's share of completed trials: the writes come as trials complete).
That backend is frozen (SIGSTOP) the moment it is seen, so the restart lands inside its
transaction rather than a poll later; it quits on the postmaster's SIGQUIT like the others.
After the restart the caught transaction's fate is read back (`pg_xact_status`): aborted
when the restart cut it, committed when its COMMIT was already under way (the coordinator
then never heard the answer). They spread over the sweep with the faults, in an order drawn
with them.

    .venv/bin/python benchmarks/chaos.py --faults 10 --seed 1
    .venv/bin/python benchmarks/chaos.py --faults 4 --mlflow-down-second-half
    .venv/bin/python benchmarks/chaos.py --faults 0 --pg-restarts-mid-write 6

Needs PostgreSQL's server programs (as scripts/cluster_up.sh does); as root the data dir
must be enterable by the postgres user, so the scratch folder is under /tmp, mode 755.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
UP, DOWN = ROOT / "scripts" / "cluster_up.sh", ROOT / "scripts" / "cluster_down.sh"
KINDS = ("coordinator", "ray-worker", "mlflow", "postgres")
PG_RESTART = "pg-restart"
# a transaction of the coordinator (its database, not this script's watcher) that has written
# (an XID is assigned at the first write) and has not ended, with the tables it wrote (a
# lease, a result, ...): read in the same query, before the backend is frozen, because a
# backend stopped while it holds a lock-manager LWLock (parsing its next statement, as seen
# once) hangs every later read of pg_locks
WRITING = ("SELECT a.pid, a.backend_xid::text, a.state, "
           "left(regexp_replace(a.query, '\\s+', ' ', 'g'), 70), "
           "ARRAY(SELECT DISTINCT c.relname::text FROM pg_locks l JOIN pg_class c "
           "ON c.oid = l.relation WHERE l.pid = a.pid AND c.relkind = 'r' "
           "AND l.mode = 'RowExclusiveLock' ORDER BY 1) "
           "FROM pg_stat_activity a WHERE a.datname = current_database() "
           "AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() "
           "AND a.application_name NOT LIKE 'hpt-chaos%'")
LRS = [2**-10, 2**-9, 2**-8, 2**-7]
LIVE = ("pending", "running")  # a sweep not yet ended


def sweep_spec(trials: int, steps: int, first_seed: int = 0,
               max_concurrent: int = 2) -> dict[str, Any]:
    """`trials` (a multiple of 4) small CPU trials, 4 LRs x seeds from `first_seed`: one shape,
    one trial per Ray task (so a fault takes down one trial, not a pack of them)."""
    seeds = trials // len(LRS)
    return {
        "name": "chaos" if first_seed == 0 else f"chaos-from-seed-{first_seed}",
        "arms": [{"arch": "gpt", "parameterization": "completep"}],
        "grid": {"widths": [32], "depths": [1], "lrs": LRS,
                 "seeds": list(range(first_seed, first_seed + seeds))},
        "fixed": {"head_dim": 32, "seq_len": 32, "base_width": 32, "base_depth": 1,
                  # an evaluation every 50 steps: at every 5 they were 43 % of a trial's CPU
                  "device": "cpu", "eval_every": 50},
        "budget": {"steps": steps, "batch_size": 4},
        "data": {"source": "stdlib", "val_tokens": 1024, "max_corpus_bytes": 400000},
        "resources": {"pack": 1},
        "max_concurrent": max_concurrent,
        # a trial may be hit by several faults (a worker host dying fails its task)
        "retries": 10,
    }


@dataclass
class Storm:
    folder: Path
    script_env: dict[str, str]
    settings: dict[str, str] = field(default_factory=dict)
    sessions: set[int] = field(default_factory=set)  # every component's session seen
    up_seconds: list[float] = field(default_factory=list)
    segments: set[tuple[int, int]] = field(default_factory=set)  # PostgreSQL's (key, shmid)
    log: list[str] = field(default_factory=list)
    _store: Any = None

    @property
    def dir(self) -> Path:
        return self.folder / "c"

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        self.log.append(line)
        print(line, file=sys.stderr, flush=True)

    def script(self, path: Path, *args: str) -> None:
        started = time.monotonic()
        proc = subprocess.run(["bash", str(path), *args], env=self.script_env,
                              capture_output=True, text=True, timeout=900)
        took = time.monotonic() - started
        if path == UP:
            self.up_seconds.append(took)
        if proc.returncode != 0:
            raise RuntimeError(f"{path.name} {' '.join(args)} failed after {took:.0f}s:\n"
                               f"{proc.stderr[-3000:]}")
        notes = [ln for ln in proc.stderr.splitlines()
                 if "already running" not in ln and ln.strip()]
        self.say(f"{' '.join([path.name, *args])}: {took:.1f}s" +
                 (f" ({'; '.join(notes)[:300]})" if notes else ""))
        self.remember_sessions()

    def up(self, *args: str) -> None:
        self.script(UP, *args)
        self.settings = dict(re.findall(r"^export (\w+)=(.*)$", (self.dir / "env").read_text(),
                                        flags=re.M))
        self.remember_segment()

    def remember_segment(self) -> None:
        """The System V segment PostgreSQL runs with (line 7 of postmaster.pid: key, shmid),
        which must not outlive the deployment."""
        try:
            key, shmid = (self.dir / "pg" / "postmaster.pid").read_text().splitlines()[6].split()
            self.segments.add((int(key), int(shmid)))
        except (OSError, IndexError, ValueError):
            pass

    def segments_left(self) -> list[tuple[int, int]]:
        return [seg for seg in _segments() if seg in self.segments]

    def remember_sessions(self) -> None:
        for f in (self.dir / "pids").glob("*"):
            try:
                self.sessions.add(int(f.read_text()))
            except (OSError, ValueError):
                pass

    def pid(self, name: str) -> int:
        if name == "postgres":
            return int((self.dir / "pg" / "postmaster.pid").read_text().split()[0])
        return int((self.dir / "pids" / name).read_text())

    def kill(self, kind: str) -> str:
        """kill -9 of one component, as described in the module docstring; returns once
        the victims are dead (a supervisor restarts what it saw die: a process still
        exiting, its threads being torn down, would pass for a running one)."""
        pid = self.pid(kind)
        if kind == "ray-worker":  # the host dies: every process of the node's session
            victims = [p for p in psutil.process_iter() if _sid(p.pid) == pid]
        else:
            victims = [psutil.Process(pid)]
        for p in victims:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        deadline = time.monotonic() + 30
        while any(_live(p) for p in victims) and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"{len(victims)} processes of session {pid}" if len(victims) > 1 \
            else f"pid {pid}"

    def restart_postgres_mid_write(self, window: float, *up_args: str) -> dict[str, Any]:
        """An immediate restart of PostgreSQL the moment a coordinator's transaction has
        written and not committed (or at the end of `window` seconds if none was seen): the
        postmaster gets SIGQUIT (`pg_ctl stop -m immediate`: its backends quit at once, open
        transactions are rolled back by crash recovery) and `cluster_up.sh` starts it. Says
        what it caught and whether that transaction ended aborted or committed."""
        import psycopg

        pid = self.pid("postgres")
        url = self.settings["HPT_DATABASE_URL"]
        caught = None
        deadline = time.monotonic() + window
        conn = psycopg.connect(url, autocommit=True, application_name="hpt-chaos-watch")
        try:
            while time.monotonic() < deadline:
                caught = conn.execute(WRITING).fetchone()
                if caught:
                    # frozen at once, that backend cannot commit before the restart lands
                    # (a poll takes longer than the coordinator's short transactions); no
                    # query follows the freeze (WRITING's comment)
                    _signal(caught[0], signal.SIGSTOP)
                    break
                time.sleep(0.002)
        finally:
            conn.close()
        os.kill(pid, signal.SIGQUIT)
        if caught:  # it may go on once the postmaster's SIGQUIT waits for it: it quits
            _continue_after_sigquit(caught[0])
        victim = psutil.Process(pid)
        deadline = time.monotonic() + 60
        while _live(victim) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.up(*up_args)
        out: dict[str, Any] = {"query": caught[3] if caught else None, "fate": None,
                               "state": caught[2] if caught else None,
                               "tables": list(caught[4]) if caught else []}
        if caught:
            out["fate"] = self.fate(int(caught[1]))
        return out

    def fate(self, xid: int) -> str:
        """How a transaction cut by a restart ended: committed or aborted. One whose XID is
        at or past the NextXID of the end-of-recovery checkpoint (the latest one, read
        seconds after it) never reached the WAL: aborted, and its XID may be handed out
        again, so pg_xact_status would tell of its new holder."""
        import psycopg

        ctl = subprocess.run([_pg_program("pg_controldata"), "-D", str(self.dir / "pg")],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        epoch, next_xid = map(int, re.search(r"NextXID:\s+(\d+):(\d+)", ctl).groups())
        if xid >= next_xid:
            return "aborted"
        url = self.settings["HPT_DATABASE_URL"]

        def status() -> str:
            with psycopg.connect(url, autocommit=True, application_name="hpt-chaos-watch") as c:
                return c.execute("SELECT pg_xact_status(%s::text::xid8)",
                                 ((epoch << 32) | xid,)).fetchone()[0]
        return _retry(status, timeout=60)

    def client(self):
        from hptransfer.client import Client

        return Client(self.settings["HPT_URL"], token=self.settings["HPT_API_TOKEN"])

    def store(self):
        """One Store for the run (its pool pings connections, so it outlives restarts)."""
        if self._store is None:
            from hptransfer.store.store import Store

            self._store = Store(self.settings["HPT_DATABASE_URL"])
        return self._store

    def ours(self) -> list[psutil.Process]:
        """Live processes of this deployment: in a session a component was started in, in
        the PostgreSQL data dir, or with this deployment's folder in their environment
        (every process cluster_up.sh starts inherits HPT_CLUSTER_DIR)."""
        marker = str(self.dir)
        pgdata = str((self.dir / "pg").resolve()) if (self.dir / "pg").exists() else None
        out = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if (_sid(p.pid) in self.sessions
                        or (pgdata and p.cwd() == pgdata)
                        or p.environ().get("HPT_CLUSTER_DIR") == marker):
                    out.append(p)
            except psutil.Error:
                pass
        return out


def _pg_program(name: str) -> str:
    """A PostgreSQL server program, found as scripts/cluster_up.sh finds them."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
                   key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return str(found[-1]) if found else (shutil.which(name) or name)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _continue_after_sigquit(pid: int, timeout: float = 3.0) -> None:
    """SIGCONT to a stopped backend once its postmaster's SIGQUIT is pending in it (then
    it quits on waking, without a step further). Else PostgreSQL SIGKILLs it after 5 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        pending = 0
        for name in ("SigPnd", "ShdPnd"):
            found = re.search(rf"^{name}:\s*([0-9a-f]+)", status, flags=re.M)
            pending |= int(found.group(1), 16) if found else 0
        if pending & (1 << (signal.SIGQUIT - 1)):
            _signal(pid, signal.SIGCONT)
            return
        time.sleep(0.01)


def _segments() -> list[tuple[int, int]]:
    """(key, shmid) of every System V shared-memory segment on the host."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [(int(r.split()[0]), int(r.split()[1])) for r in rows if r.strip()]


def _live(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _retry(what, timeout: float = 300.0, pause: float = 1.0):
    """what() once it stops raising (the database or the API may be coming back)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return what()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)


def _completed(storm: Storm, sweep_id: str) -> tuple[int, str]:
    """(trials completed, sweep status), read from PostgreSQL."""
    store = storm.store()
    return store.count_trials(sweep_id, status="completed"), store.get_sweep(sweep_id).status


def storm(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    # every kind once first (in a random order), then random draws
    kinds = rng.sample(KINDS, len(KINDS)) + [rng.choice(KINDS) for _ in range(args.faults)]
    kinds = kinds[:args.faults]
    if args.pg_restarts_mid_write:  # among the faults, in a drawn order
        kinds += [PG_RESTART] * args.pg_restarts_mid_write
        rng.shuffle(kinds)
    wanted = args.trials or 3 * len(kinds) + 4
    trials = len(LRS) * -(-wanted // len(LRS))  # whole seeds of the LR grid
    folder = Path(tempfile.mkdtemp(prefix="hptchaos", dir="/tmp"))
    folder.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HPT_", "RAY_", "MLFLOW_"))}
    env.update(PYTHON=sys.executable, HPT_CLUSTER_DIR=str(folder / "c"), OMP_NUM_THREADS="1",
               # the head notices a dead worker node in ~1.5 s, not 15 s
               RAY_health_check_period_ms="500", RAY_health_check_timeout_ms="500",
               RAY_health_check_failure_threshold="3")
    if args.no_ray_dashboard:
        env["HPT_RAY_DASHBOARD"] = "0"
    s = Storm(folder, env)
    failures: list[str] = []
    done_kinds: Counter[str] = Counter()
    restarts: list[dict[str, Any]] = []  # what each PostgreSQL restart caught
    started = time.monotonic()
    summary: dict[str, Any] = {}
    try:
        s.up()
        sweeps: dict[str, int] = {}  # every sweep submitted: its trials

        def submit(size: int) -> str:  # seeds of its own: its trials are not an earlier sweep's
            spec = sweep_spec(size, args.steps, first_seed=sum(sweeps.values()) // len(LRS),
                              max_concurrent=args.max_concurrent)
            with s.client() as c:
                one = c.submit(spec)["id"]
            sweeps[one] = size
            return one

        sweep_id = submit(trials)
        s.say(f"sweep {sweep_id}: {trials} trials; events: {' '.join(kinds)}")
        mlflow_down = False

        def second_half(n: int) -> None:  # the MLflow server down from half the sweep on
            nonlocal mlflow_down
            if args.mlflow_down_second_half and not mlflow_down and n >= trials // 2:
                s.script(DOWN, "mlflow")
                mlflow_down = True
                summary["mlflow_down_at"] = f"{n}/{trials}"
                s.say(f"MLflow server stopped at {n}/{trials} trials completed")

        last = 0
        for i, kind in enumerate(kinds):
            # spread over the sweep: fault i once i / (faults + 1) of it completed, and on a
            # sweep making progress (a trial more completed since the last fault); in a sweep
            # submitted for the events left, at each trial completed
            goal = (max(last + 1, (i + 1) * trials // (len(kinds) + 1)) if len(sweeps) == 1
                    else last + 1)
            deadline = time.monotonic() + args.fault_wait
            while True:
                n, status = _retry(lambda one=sweep_id: _completed(s, one))
                second_half(n)
                if status == "completed" and not args.mlflow_down_second_half:
                    # the sweep ended before the storm (its trials trained faster than the
                    # restores took): another keeps the deployment busy; every sweep is checked.
                    # It holds a trial per event left and one more (so it outlasts them unless
                    # the restores outlast its trials again: then another follows), not a
                    # whole first sweep's worth: what is left of it after the last event
                    # trains for nothing but the checks
                    size = min(trials, len(LRS) * -(-(len(kinds) - i + 1) // len(LRS)))
                    sweep_id, goal, last = submit(size), 1, 0
                    s.say(f"sweep {sweep_id}: {size} more trials for the "
                          f"{len(kinds) - i} events left")
                    continue
                if n >= goal or status not in LIVE or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if status not in LIVE:
                failures.append(f"the sweep ended ({status}) after {i} of {len(kinds)} "
                                f"events: give it more --trials")
                break
            if kind == PG_RESTART:
                got = s.restart_postgres_mid_write(
                    args.fault_wait, *(["--without", "mlflow"] if mlflow_down else []))
                restarts.append(got)
                s.say(f"event {i + 1}/{len(kinds)}: PostgreSQL restarted "
                      + (f"during a write to {', '.join(got['tables']) or '? (locks gone)'} "
                         f"({got['state']}: {got['query']}), which ended {got['fate']}"
                         if got["query"]
                         else "(no write seen in "
                         f"{args.fault_wait:.0f}s)") + f"; {n} completed")
                last = n
                continue
            if mlflow_down and kind == "mlflow":  # it is down already: another kind
                kind = rng.choice([k for k in KINDS if k != "mlflow"])
            time.sleep(rng.uniform(0, args.jitter))
            what = s.kill(kind)
            done_kinds[kind] += 1
            s.say(f"event {i + 1}/{len(kinds)}: kill -9 {kind} ({what}); {n} completed")
            # cluster_up.sh restores whatever is not running, save an MLflow meant to be down
            s.up(*(["--without", "mlflow"] if mlflow_down else []))
            last = n
        while args.mlflow_down_second_half and not mlflow_down:
            n, status = _retry(lambda: _completed(s, sweep_id))
            second_half(n if status == "running" else trials)
            time.sleep(0.5)
        finals = {}
        with s.client() as c:
            for one in sweeps:
                finals[one] = _retry(lambda one=one: c.wait(one, poll=0.2, timeout=args.timeout,
                                                            progress=False))
                s.say(f"sweep {one} {finals[one]['status']}")
        if mlflow_down:  # results kept while it was down, mirrored now it is back
            backlog = s.store().mirror_backlog(sweep_id)
            summary["backlog"] = backlog
            s.say(f"{backlog} attempts waiting for the MLflow server; starting it again")
            if not backlog:
                failures.append("nothing waited for the MLflow server while it was down")
            s.up()
        checked = [check(s, one, sweeps[one], final, failures) for one, final in finals.items()]
        summary.update(
            completed=sum(c["completed"] for c in checked), trials=sum(sweeps.values()),
            attempts_max=max(c["attempts_max"] for c in checked),
            runs_per_trial="/".join(sorted({k for c in checked
                                            for k in c["runs_per_trial"].split("/")})))
    except Exception as e:  # a failed restart or a hung sweep is a finding, not a crash
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        # the process accounting below must see the deployment while it runs
        before = Counter(_name(p) for p in s.ours())
        s.say(f"{sum(before.values())} processes of the deployment before cluster_down.sh: "
              + ", ".join(f"{k} {v}" for k, v in before.most_common()))
        if not before:
            failures.append("no process of the deployment found while it ran")
        try:
            s.script(DOWN)
        except Exception as e:
            failures.append(f"cluster_down.sh: {e}")
        # what cluster_down.sh stopped may take a moment to exit: a second, as before, but
        # no longer than it takes
        deadline = time.monotonic() + 1
        while (left := s.ours()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            failures.append("processes left after cluster_down.sh: " + "; ".join(
                f"{p.pid} {' '.join(_cmd(p))[:80]}" for p in left[:10]))
            for p in left:  # ours: do not leave them on the machine
                try:
                    p.kill()
                except psutil.Error:
                    pass
        summary["leftover"] = len(left)
        if args.keep:
            s.say(f"kept {s.dir}")
        else:
            subprocess.run(["bash", str(DOWN), "--purge"], env=env, capture_output=True,
                           timeout=300)
            shutil.rmtree(folder, ignore_errors=True)
            shm = s.segments_left()
            if shm:
                failures.append(f"PostgreSQL's shared memory left after --purge: {shm}")
            summary["shm_left"] = len(shm)
    wall = time.monotonic() - started
    by_kind = ", ".join(f"{k} {done_kinds[k]}" for k in KINDS)
    line = (f"chaos: faults={sum(done_kinds.values())} ({by_kind}) "
            f"trials={summary.get('completed', '?')}/{summary.get('trials', trials)} completed "
            f"attempts_max={summary.get('attempts_max', '?')} "
            f"finished_runs_per_trial={summary.get('runs_per_trial', '?')} "
            f"cluster_up_max={max(s.up_seconds, default=0):.1f}s "
            f"leftover_processes={summary['leftover']} "
            f"shm_left={summary.get('shm_left', '?')} "
            + (f"pg_restarts={len(restarts)} "
               f"writes_caught={sum(r['query'] is not None for r in restarts)} "
               f"writes_aborted={sum(r['fate'] == 'aborted' for r in restarts)} "
               if args.pg_restarts_mid_write else "")
            + (f"mlflow_down_at={summary.get('mlflow_down_at', '?')} "
               f"mirrored_after={summary.get('backlog', '?')} "
               if args.mlflow_down_second_half else "") +
            f"wall={wall:.0f}s seed={args.seed} {'OK' if not failures else 'FAILED'}")
    for f in failures:
        print(f"chaos: FAILED: {f}", file=sys.stderr)
    print(line, flush=True)
    return 1 if failures else 0


def _name(p: psutil.Process) -> str:
    """A process's kind for the log: its title up to the first space or colon."""
    try:
        title = " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return "?"
    first = re.split(r"[\s:(]", title, maxsplit=1)[0]
    return Path(first).name or title[:20]


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return ["?"]


def check(s: Storm, sweep_id: str, trials: int, final: dict, failures: list[str]) -> dict:
    """The end state: every trial completed exactly once, in PostgreSQL and in MLflow."""
    from mlflow.tracking import MlflowClient

    store = s.store()
    if final["status"] != "completed":
        failures.append(f"sweep status {final['status']}")
    deadline = time.monotonic() + 180  # the mirror catches up after the sweep ends
    while (backlog := store.mirror_backlog(sweep_id)) > 0:
        if time.monotonic() > deadline:
            failures.append(f"the MLflow mirror never caught up ({backlog} left)")
            break
        time.sleep(0.2)
    rows = store.trials(sweep_id, limit=None)
    if len(rows) != trials:
        failures.append(f"{len(rows)} trials stored, {trials} expected")
    bad = [(r.id, r.status) for r in rows if r.status != "completed"]
    if bad:
        failures.append(f"trials not completed: {bad[:5]}")
    attempts = {r.id: store.attempts(r.id) for r in rows}
    for r in rows:
        got = Counter(a.status for a in attempts[r.id])
        if got["completed"] != 1:
            failures.append(f"trial {r.id}: {got['completed']} completed attempts {dict(got)}")
        if r.attempts != len(attempts[r.id]):
            failures.append(f"trial {r.id}: attempts={r.attempts}, "
                            f"{len(attempts[r.id])} attempt rows")
    sweep = store.get_sweep(sweep_id)
    ml = MlflowClient(tracking_uri=s.settings["MLFLOW_TRACKING_URI"])
    runs = ml.search_runs([sweep.mlflow_experiment_id], max_results=50000)
    trial_runs = [r for r in runs if r.data.tags.get("hpt.trial_id")]
    finished = Counter(r.data.tags["hpt.trial_id"] for r in trial_runs
                       if r.info.status == "FINISHED")
    per_trial = Counter(finished[r.id] for r in rows)
    if set(per_trial) != {1}:
        failures.append(f"FINISHED MLflow runs per trial (runs: trials): {dict(per_trial)}")
    deadline = time.monotonic() + 120  # the sweep's own run ends after its fits
    while (parent := ml.get_run(sweep.mlflow_run_id).info.status) != "FINISHED":
        if time.monotonic() > deadline:
            failures.append(f"the sweep's MLflow run is {parent}")
            break
        time.sleep(0.2)
    running = [r.info.run_id for r in runs if r.info.status == "RUNNING"]
    if running:
        failures.append(f"{len(running)} MLflow runs left RUNNING")
    for r in rows:  # the finished run holds the trial's own result
        fin = [m for m in trial_runs
               if m.data.tags["hpt.trial_id"] == r.id and m.info.status == "FINISHED"]
        if len(fin) == 1 and r.final_val_loss is not None:
            got = fin[0].data.metrics.get("final_val_loss")
            if got is None or abs(got - r.final_val_loss) > 1e-6 * max(1, abs(got)):
                failures.append(f"trial {r.id}: MLflow final_val_loss {got}, "
                                f"stored {r.final_val_loss}")
    return {"completed": sum(r.status == "completed" for r in rows),
            "attempts_max": max((r.attempts for r in rows), default=0),
            "runs_per_trial": "/".join(str(k) for k in sorted(per_trial)) or "?"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=10, help="kill -9s to inject (default 10)")
    p.add_argument("--seed", type=int, default=0, help="draws the faults and their moments")
    p.add_argument("--trials", type=int, default=0,
                   help="trials of the sweep (default 3 x faults + 4: it lasts through them)")
    p.add_argument("--steps", type=int, default=2000,
                   help="training steps per trial (2000: ~4 s of CPU)")
    p.add_argument("--max-concurrent", type=int, default=2,
                   help="trials in flight (2: one on each worker node; 1: half the CPU, "
                        "as the storm's length, not its trials, sets what it trains)")
    p.add_argument("--jitter", type=float, default=2.0,
                   help="a random pause of up to this many seconds before each fault")
    p.add_argument("--fault-wait", type=float, default=60.0,
                   help="at most this long for a trial to complete between two faults")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="for the sweep to end after the last fault")
    p.add_argument("--mlflow-down-second-half", action="store_true",
                   help="the MLflow server down from half the sweep until it ended")
    p.add_argument("--pg-restarts-mid-write", type=int, default=0, metavar="N",
                   help="N immediate restarts of PostgreSQL, each while the coordinator "
                        "writes (see above)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs)")
    p.add_argument("--no-ray-dashboard", action="store_true",
                   help="the Ray head without its dashboard (HPT_RAY_DASHBOARD=0): less CPU")
    args = p.parse_args(argv)
    if args.faults < 0 or args.pg_restarts_mid_write < 0:
        p.error("--faults and --pg-restarts-mid-write must be >= 0")
    return storm(args)


if __name__ == "__main__":
    sys.exit(main())
