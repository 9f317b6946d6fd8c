"""Faults around the dispatcher with real components: an app database that cannot be written
while trials finish (`chattr +i` on the SQLite files), and a stored sweep whose spec no
longer validates. Nothing is dropped, the loop backs off and logs once per outage, and one bad
sweep never blocks the others."""

from __future__ import annotations

import logging
import shutil
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path

import optuna
import psycopg
import pytest
import ray
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError
from waiting import run_sweep, wait_for

from hptransfer.api.app import create_app
from hptransfer.config import get_settings
from hptransfer.contracts.status import ACTIVE
from hptransfer.coordinator.optuna_search import first_batch
from hptransfer.coordinator.plan import plan_shapes, plan_sweep
from hptransfer.coordinator.service import Coordinator
from hptransfer.spec import load_spec
from hptransfer.store.store import Store


def chattr(flag: str, files: list[Path]) -> bool:
    done = subprocess.run(["chattr", flag, *map(str, files)], capture_output=True)
    return done.returncode == 0


def immutable_supported(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_text("x")
    if shutil.which("chattr") is None or not chattr("+i", [probe]):
        return False
    try:
        try:
            probe.write_text("y")
        except OSError:
            return True
        return False
    finally:
        chattr("-i", [probe])


def test_results_survive_an_unwritable_database_and_the_loop_backs_off(
        hpt_home, ray_cluster, tiny_spec, tmp_path, caplog, monkeypatch):
    if not immutable_supported(tmp_path):
        pytest.skip("needs chattr +i (root on ext4/xfs) to make the database unwritable")
    tiny_spec.update(name="db-outage", max_concurrent=2, reuse=False)
    tiny_spec["grid"]["lrs"] = [2.0**-8, 2.0**-6]
    # seconds of training, after a worker's start-up: neither trial ends before the lock below
    tiny_spec["budget"] = {"steps": 400, "batch_size": 4}
    settings = get_settings()
    coordinator = Coordinator(settings)
    dispatcher = coordinator.dispatcher
    failed_ticks = {"n": 0}
    real_tick = dispatcher.run_once

    def counted_tick() -> bool:
        try:
            return real_tick()
        except Exception:
            failed_ticks["n"] += 1
            raise

    monkeypatch.setattr(dispatcher, "run_once", counted_tick)
    caplog.set_level(logging.INFO, logger="hptransfer.coordinator.dispatch")
    # the database and its write-ahead log, where every write lands; not the -shm index, the
    # one file SQLite memory-maps: with it immutable too, a CI run's pytest once died of
    # SIGBUS inside SQLite
    db_files = [Path(settings.home) / name for name in ("hpt.db", "hpt.db-wal")]
    coordinator.start()
    locked = False
    try:
        sweep = coordinator.submit(tiny_spec)
        # locked once both trials are leased and submitted (the leases are written), before
        # either can finish: not once both are training, as the first, on a worker left warm
        # by an earlier test, can train to its end before the second's worker has started
        wait_for(lambda: len(dispatcher.in_flight) == 2, 120, "both trials to be submitted")
        refs = [f.ref for f in dispatcher.in_flight.values()]
        caplog.clear()
        assert chattr("+i", [f for f in db_files if f.exists()])
        locked = True
        # both trials finish during the outage, as a rule; on a loaded machine the second may
        # still be starting up (its result then comes after the outage)
        finished, _ = ray.wait(refs, num_returns=2, timeout=240)
        assert finished, "no trial finished during the outage"
        wait_for(lambda: dispatcher.last_error, 60, "a failed database write")
        # the outcomes are kept, not dropped: both trials are still in flight, each finished
        # one's result held in memory
        wait_for(lambda: all(f.outcome for f in dispatcher.in_flight.values()
                             if f.ref in finished), 60, "the finished trials' outcomes")
        assert len(dispatcher.in_flight) == 2
        assert all(f.outcome is None or f.outcome.status == "completed"
                   for f in dispatcher.in_flight.values())
        wait_for(lambda: failed_ticks["n"] >= 4, 60, "retries during the outage")
        outage_ticks, backoff_s = failed_ticks["n"], dispatcher.ticks.delay
        assert chattr("-i", [f for f in db_files if f.exists()])
        locked = False
        wait_for(lambda: coordinator.store.get_sweep(sweep["id"]).status == "completed",
                 120, "the sweep to complete once the database is writable")
    finally:
        if locked:
            chattr("-i", [f for f in db_files if f.exists()])
        coordinator.stop()
    rows = coordinator.store.trials(sweep["id"], limit=None)
    assert [r.status for r in rows] == ["completed", "completed"]
    assert all(r.result and r.final_val_loss is not None and r.attempts == 1
               for r in rows)
    # one log line when the outage starts, one when it ends; not one per tick
    lines = [r.getMessage() for r in caplog.records if r.name == "hptransfer.coordinator.dispatch"]
    assert outage_ticks >= 4
    # backed off: the pause doubles with each failed tick, from one poll interval; by the 4th
    # (counted before the loop notes it) the 3 before it have made it 4 poll intervals at least
    assert backoff_s >= 4 * dispatcher.poll_interval, (outage_ticks, backoff_s)
    assert sum("dispatch failing" in m for m in lines) == 1, lines
    assert sum("dispatch recovered" in m for m in lines) == 1, lines
    assert len(lines) == 2, lines


def test_a_connection_opened_while_the_database_was_unwritable_is_not_kept(
        tmp_path, tiny_spec):
    """SQLite opens a connection read-only for good when its files are unwritable at the time
    (a full disk, a read-only remount, `chattr +i` here): after the outage every write on it
    still fails "attempt to write a readonly database". Such a connection is dropped from the
    pool on that error, so the first write after the outage succeeds on a fresh one."""
    if not immutable_supported(tmp_path):
        pytest.skip("needs chattr +i (root on ext4/xfs) to make the database unwritable")
    db = tmp_path / "app.db"
    store = Store(f"sqlite:///{db}")
    store.migrate()
    spec = load_spec(tiny_spec)
    sweep_id = store.create_sweep(name="outage", spec=spec.model_dump(mode="json"),
                                  spec_hash="x", search="grid", planned=plan_sweep(spec),
                                  reuse=False, max_concurrent=2)
    keeper = sqlite3.connect(db)  # holds the write-ahead log open, as a busy server would
    keeper.execute("SELECT count(*) FROM sweeps").fetchone()
    store.engine.dispose()  # the next write opens its connection during the outage
    files = [db, tmp_path / "app.db-wal"]
    assert chattr("+i", files)
    try:
        with pytest.raises(OperationalError, match="readonly database"):
            store.set_sweep_status(sweep_id, "running")
    finally:
        assert chattr("-i", files)
    store.set_sweep_status(sweep_id, "running")
    store.set_sweep_status(sweep_id, "cancelled")
    assert store.get_sweep(sweep_id).status == "cancelled"
    store.close()
    keeper.close()


def _one_at_a_time_optuna(tiny_spec: dict, name: str) -> tuple:
    """`tiny_spec` made an Optuna search of 3 trials run one at a time; settings and a
    coordinator (not started)."""
    tiny_spec.update(name=name, max_concurrent=1, reuse=False,
                     search={"method": "optuna", "sampler": "tpe", "n_trials": 3})
    settings = get_settings()
    return settings, Coordinator(settings)


def _outage(statement: str) -> OperationalError:
    """What SQLAlchemy raises for a write the database cannot do."""
    return OperationalError(statement, {}, Exception("disk I/O error"))


def test_follow_ups_of_a_stored_result_that_fail_to_write_are_retried(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """Once a trial's result is stored, its Optuna tell and its sweep's status update are
    still to write; when those writes fail (a database outage that outlasts the result's own
    write), a later tick writes them. They used to leave with the trial's in-flight entry: the
    last trial's failed refresh left its sweep 'running' forever with every trial done, and a
    failed tell left the Optuna trial running, its result unheard."""
    settings, coordinator = _one_at_a_time_optuna(tiny_spec, "owed")
    store, dispatcher = coordinator.store, coordinator.dispatcher
    outage = _outage("UPDATE sweeps")
    failures = {"tell": 0, "refresh": 0}
    real_tell, real_refresh = dispatcher.optuna_bridge.search.tell, store.refresh_sweep_status

    def flaky_tell(*args, **kwargs):  # the first tell of each trial fails
        failures["tell"] += 1
        if failures["tell"] % 2:
            raise outage
        return real_tell(*args, **kwargs)

    def flaky_refresh(sweep_id: str) -> str:  # fails twice once the last trial is stored
        if not store.count_trials(sweep_id, status=list(ACTIVE)) and failures["refresh"] < 2:
            failures["refresh"] += 1
            raise outage
        return real_refresh(sweep_id)

    monkeypatch.setattr(dispatcher.optuna_bridge.search, "tell", flaky_tell)
    monkeypatch.setattr(store, "refresh_sweep_status", flaky_refresh)
    sweep_id = run_sweep(coordinator, tiny_spec, 180)
    assert failures == {"tell": 6, "refresh": 2} and not dispatcher.recovery.pending_follow_ups
    rows = store.trials(sweep_id, limit=None)
    assert len(rows) == 3 and {r.status for r in rows} == {"completed"}
    # every result reached its study, once
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    told = {t.number: t for t in optuna.load_study(
        study_name=name, storage=settings.optuna_url).get_trials(deepcopy=False)}
    assert sorted(told) == sorted(r.optuna_trial_number for r in rows)
    for row in rows:
        frozen = told[row.optuna_trial_number]
        assert frozen.state == optuna.trial.TrialState.COMPLETE
        assert frozen.value == pytest.approx(row.final_val_loss, rel=1e-12)


def test_a_restart_completes_a_sweep_whose_last_refresh_died_with_its_coordinator(
        hpt_home, ray_cluster, tiny_spec):
    """Every trial stored, the sweep not yet refreshed, the coordinator gone (its pending
    follow-ups lived in its memory): the next coordinator's start completes the sweep. An
    Optuna sweep with trials still to ask stays active."""
    settings = get_settings()
    dead = Coordinator(settings)
    grid_id = dead.submit(dict(tiny_spec, name="settled"))["id"]
    optuna_id = dead.submit(dict(tiny_spec, name="asking", search={
        "method": "optuna", "sampler": "tpe", "n_trials": 3}))["id"]
    for trial in dead.store.lease_pending("dead-coordinator", 10, sweep_id=grid_id):
        assert dead.store.finish_trial(trial.id, "completed", None, None, None)
    dead.store.set_sweep_status(grid_id, "running")
    assert dead.store.count_trials(grid_id, status="completed") == 3
    coordinator = Coordinator(settings)
    coordinator.start(background=False)
    try:
        assert coordinator.store.get_sweep(grid_id).status == "completed"
        assert coordinator.store.get_sweep(optuna_id).status in ("pending", "running")
    finally:
        coordinator.stop()


def test_a_restart_tells_optuna_what_its_dead_coordinator_stored_but_did_not_tell(
        hpt_home, ray_cluster, tiny_spec):
    """A coordinator killed between storing a trial's result and telling Optuna, or between
    asking Optuna and adding the trial's row, left those Optuna trials RUNNING: the sampler
    never heard the value and the bracketing waited on them. The next coordinator's start
    tells each its stored outcome, retracts one without a row (FAIL, its LR enqueued again)
    and leaves unfinished ones open."""
    settings = get_settings()
    dead = Coordinator(settings)
    sweep_id = dead.submit(dict(tiny_spec, name="untold", search={
        "method": "optuna", "sampler": "tpe", "n_trials": 6}))["id"]
    sweep = dead.store.get_sweep(sweep_id)
    spec = load_spec(sweep.spec)
    dead.dispatcher.optuna_asker.ask(sweep, spec, free=1)  # the first batch: rows + RUNNING trials
    asked = dead.store.trials(sweep_id, limit=None)
    assert len(asked) >= 3
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    # asked, then killed before its row was added
    search = dead.dispatcher.optuna_bridge.search
    phantom, phantom_lr = search.ask(search._studies[name], *spec.grid.lr_bounds())
    leased = {t.id: t for t in dead.store.lease_pending("dead", 2, sweep_id=sweep_id)}
    done, diverged = list(leased)
    assert dead.store.finish_trial(done, "completed", {"status": "completed",
                                                       "final_val_loss": 3.25}, None, None)
    assert dead.store.finish_trial(diverged, "diverged", {"status": "diverged"}, None, None)
    coordinator = Coordinator(settings)
    coordinator.start(background=False)
    try:
        states = {t.number: t for t in optuna.load_study(
            study_name=name, storage=settings.optuna_url).get_trials(deepcopy=False)}
        number = {tid: leased[tid].optuna_trial_number for tid in leased}
        assert states[number[done]].state == optuna.trial.TrialState.COMPLETE
        assert states[number[done]].value == 3.25
        assert states[number[diverged]].state == optuna.trial.TrialState.COMPLETE
        assert states[number[diverged]].user_attrs.get("hpt_diverged") is True
        assert states[phantom].state == optuna.trial.TrialState.FAIL
        # retracted: its LR is asked again by the next ask
        assert [t.system_attrs["fixed_params"]["lr"] for t in states.values()
                if t.state == optuna.trial.TrialState.WAITING] == [phantom_lr]
        untouched = [t for t in asked if t.id not in leased]
        assert untouched and all(  # not finished: told when they are
            states[t.optuna_trial_number].state == optuna.trial.TrialState.RUNNING
            for t in untouched)
    finally:
        coordinator.stop()


@pytest.mark.postgres
def test_optuna_storage_on_postgresql_is_used_again_after_a_read_only_spell(
        hpt_home, ray_cluster, tiny_spec, postgres_url, monkeypatch, caplog):
    """Optuna's storage on PostgreSQL turns read-only for a while (as after a failover to a
    standby) and its sessions are cut. A session reopened during that spell stays read-only
    after it: kept in the pool, it failed every other call for good (the outage "recovered"
    and "failed" again on each tell). Dropping the pool on each failure
    (`OptunaSearch.reconnect`) ends the outage once: one log line when it starts, one when it
    ends, and the sweep completes with every result told."""
    name = f"hpt_optuna_{uuid.uuid4().hex[:10]}"
    optuna_url = f"{postgres_url.rsplit('/', 1)[0]}/{name}"
    admin = psycopg.connect(postgres_url, autocommit=True)
    admin.execute(f"CREATE DATABASE {name}")

    def cut_sessions() -> None:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))

    try:
        monkeypatch.setenv("HPT_OPTUNA_URL", optuna_url)
        coordinator = Coordinator(get_settings())
        store, dispatcher = coordinator.store, coordinator.dispatcher
        caplog.set_level(logging.INFO, logger="hptransfer.coordinator.dispatch")
        searched = dict(tiny_spec, name="optuna-read-only", max_concurrent=1, reuse=False,
                        search={"method": "optuna", "sampler": "tpe", "n_trials": 3},
                        resources={"cpus": 1, "pack": 1}, budget={"steps": 100, "batch_size": 4})
        # the spell starts while the first of 3 trials trains: its tell, or a later one, meets it
        coordinator.start()
        try:
            sweep_id = coordinator.submit(searched)["id"]
            wait_for(lambda: dispatcher.in_flight, 120, "the first Optuna trial's lease")
            admin.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
            cut_sessions()
            wait_for(lambda: "read-only" in (dispatcher.optuna_storage.error or ""), 120,
                     "a write refused by the read-only storage")
            assert store.get_sweep(sweep_id).status == "running"
            admin.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")
            wait_for(lambda: store.get_sweep(sweep_id).status == "completed", 120,
                     lambda: f"the sweep to complete ({dispatcher.optuna_storage.error})")
        finally:
            coordinator.stop()
        rows = store.trials(sweep_id, limit=None)
        assert len(rows) == 3 and {r.status for r in rows} == {"completed"}
        (study,) = [n for n in optuna.get_all_study_names(optuna_url) if sweep_id in n]
        told = {t.number: t for t in optuna.load_study(
            study_name=study, storage=optuna_url).get_trials(deepcopy=False)}
        for row in rows:
            assert told[row.optuna_trial_number].state == optuna.trial.TrialState.COMPLETE
            assert told[row.optuna_trial_number].value == pytest.approx(row.final_val_loss,
                                                                        rel=1e-12)
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "hptransfer.coordinator.dispatch"]
        assert sum("Optuna's storage failing" in m for m in lines) == 1, lines
        assert sum("Optuna's storage recovered" in m for m in lines) == 1, lines
        assert dispatcher.optuna_storage.error is None
    finally:
        cut_sessions()
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.close()


def test_a_restart_while_optunas_storage_fails_tells_the_study_once_it_answers(
        hpt_home, ray_cluster, tiny_spec, tmp_path):
    """A coordinator started while Optuna's storage fails still starts (grid sweeps need no
    Optuna); the results its dead predecessor stored but did not tell reach the study on a
    later tick, and only then does the sweep, all of whose trials are done, complete."""
    import time

    if not immutable_supported(tmp_path):
        pytest.skip("needs chattr +i (root on ext4/xfs) to make the database unwritable")
    settings = get_settings()
    dead = Coordinator(settings)
    sweep_id = dead.submit(dict(tiny_spec, name="untold-outage", search={
        "method": "optuna", "sampler": "tpe", "n_trials": 3}))["id"]
    sweep = dead.store.get_sweep(sweep_id)
    dead.dispatcher.optuna_asker.ask(sweep, load_spec(sweep.spec), free=1)  # the first batch
    leased = dead.store.lease_pending("dead", 3, sweep_id=sweep_id)
    assert len(leased) == 3
    for i, trial in enumerate(leased):  # stored, then the coordinator died before telling
        assert dead.store.finish_trial(trial.id, "completed", {
            "status": "completed", "final_val_loss": 3.0 + i / 4}, None, None)
    storage = [Path(settings.home) / "optuna.db"]
    coordinator = Coordinator(settings)
    dispatcher = coordinator.dispatcher
    assert chattr("+i", storage)
    try:
        coordinator.start(background=False)
        assert dispatcher.recovery.optuna_sweeps_to_resync == {sweep_id}
        assert dispatcher.optuna_storage.error
        dispatcher.run_once()
        assert coordinator.store.get_sweep(sweep_id).status == "running"  # not yet told: not done
    finally:
        assert chattr("-i", storage)
    try:
        deadline = time.monotonic() + 60
        resync = dispatcher.recovery.optuna_sweeps_to_resync
        while resync and time.monotonic() < deadline:  # ticks, by hand
            dispatcher.run_once()
            time.sleep(0.05)
        assert not dispatcher.recovery.optuna_sweeps_to_resync
        assert dispatcher.optuna_storage.error is None
        assert coordinator.store.get_sweep(sweep_id).status == "completed"
    finally:
        coordinator.stop()
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    told = {t.number: t for t in optuna.load_study(
        study_name=name, storage=settings.optuna_url).get_trials(deepcopy=False)}
    for i, trial in enumerate(leased):
        assert told[trial.optuna_trial_number].state == optuna.trial.TrialState.COMPLETE
        assert told[trial.optuna_trial_number].value == 3.0 + i / 4


def test_an_asked_trial_whose_row_cannot_be_added_is_retracted_and_asked_again(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """Optuna asked, then the app database refused the trial's row (an outage): the asked
    Optuna trial is told FAIL and its LR (here one of the first batch) is enqueued again, so
    no phantom stays RUNNING and the study's plan loses no LR. When Optuna's storage fails
    too at that moment, a later tick retracts it."""
    settings, coordinator = _one_at_a_time_optuna(tiny_spec, "unadded")
    store, dispatcher = coordinator.store, coordinator.dispatcher
    outage = _outage("INSERT INTO trials")
    failed = {"add": 0, "retract": 0}
    real_add, real_retract = store.add_trial, dispatcher.optuna_bridge.search.retract

    def flaky_add(*args, **kwargs):  # the second trial's row fails once
        if store.count_trials(args[0]) == 1 and not failed["add"]:
            failed["add"] += 1
            raise outage
        return real_add(*args, **kwargs)

    def flaky_retract(*args, **kwargs):  # and Optuna's storage fails the first retraction
        if not failed["retract"]:
            failed["retract"] += 1
            raise outage
        return real_retract(*args, **kwargs)

    monkeypatch.setattr(store, "add_trial", flaky_add)
    monkeypatch.setattr(dispatcher.optuna_bridge.search, "retract", flaky_retract)
    sweep_id = run_sweep(coordinator, tiny_spec, 180)
    assert failed == {"add": 1, "retract": 1} and not dispatcher.recovery.asks_to_retract
    rows = store.trials(sweep_id, limit=None)
    assert len(rows) == 3 and {r.status for r in rows} == {"completed"}
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    trials = optuna.load_study(study_name=name, storage=settings.optuna_url).get_trials(
        deepcopy=False)
    states = {t.number: t.state for t in trials}
    (retracted,) = [t for t in trials if t.number not in {r.optuna_trial_number for r in rows}]
    assert retracted.state == optuna.trial.TrialState.FAIL
    assert all(states[r.optuna_trial_number] == optuna.trial.TrialState.COMPLETE for r in rows)
    # the three LRs trained are the first batch's three, the retracted one among them
    spec = load_spec(store.get_sweep(sweep_id).spec)
    (shape,) = plan_shapes(spec)
    planned = first_batch(dispatcher.optuna_bridge.study_name("", shape), *spec.grid.lr_bounds(), 3)
    assert sorted(r.lr for r in rows) == pytest.approx(sorted(planned), rel=1e-12)
    assert retracted.params["lr"] in planned


def _tick_until_completed(coordinator: Coordinator, sweep_id: str,
                          tolerated: type[Exception], timeout: float = 120) -> list[Exception]:
    """The dispatch loop's ticks, by hand, until the sweep completes; the `tolerated` errors
    ticks raised meanwhile (the loop backs off on them)."""
    store, dispatcher = coordinator.store, coordinator.dispatcher
    raised, deadline = [], time.monotonic() + timeout
    while store.get_sweep(sweep_id).status != "completed":
        assert time.monotonic() < deadline, (dispatcher.recovery.leases_to_release,
                                             store.status_counts(sweep_id))
        try:
            dispatcher.run_once()
        except tolerated as exc:
            raised.append(exc)
        time.sleep(0.05)
    return raised


def _submit_and_tick(coordinator: Coordinator, spec: dict,
                     tolerated: type[Exception]) -> tuple[str, list[Exception]]:
    """Submit `spec`, tick by hand until it completes, stop the coordinator; the sweep's id
    and the tolerated errors raised."""
    sweep_id = coordinator.submit(spec)["id"]
    try:
        return sweep_id, _tick_until_completed(coordinator, sweep_id, tolerated)
    finally:
        coordinator.stop()


def _released_then_trained(store: Store, rows: list) -> list[str]:
    """The trials whose first lease was given back unstarted, then trained."""
    from hptransfer.store.store import NOT_STARTED

    released = [r.id for r in rows if [a.status for a in store.attempts(r.id)] == [
        "cancelled", "completed"]]
    assert all(store.attempts(t)[0].error == NOT_STARTED for t in released)
    return released


def test_leased_trials_whose_task_cannot_be_submitted_go_back_to_pending(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """Ray refused a task (a cluster connection lost between leasing and submitting): every
    trial leased in that tick goes back to pending, its attempt not counted, rather than
    staying 'running' with no task until the coordinator restarts. When the database fails
    that release too, a later tick does it."""
    tiny_spec.update(name="unsubmitted", max_concurrent=2, reuse=False)
    tiny_spec["resources"] = {"cpus": 1, "pack": 1}
    coordinator = Coordinator(get_settings())
    store, dispatcher = coordinator.store, coordinator.dispatcher
    coordinator.start(background=False)
    refused = ConnectionError("Ray cluster unreachable")
    failed = {"submit": 0, "release": 0}
    real_remote, real_release = dispatcher.ray_runner.run_trial, store.release

    class FlakyRemote:  # the first submission is refused
        def options(self, **options):
            task = real_remote.options(**options)

            class Submit:
                def remote(self, *args):
                    if not failed["submit"]:
                        failed["submit"] += 1
                        raise refused
                    return task.remote(*args)
            return Submit()

    def flaky_release(*args, **kwargs):  # and so is the first release
        if not failed["release"]:
            failed["release"] += 1
            raise _outage("UPDATE trials")
        return real_release(*args, **kwargs)

    monkeypatch.setattr(dispatcher.ray_runner, "run_trial", FlakyRemote())
    monkeypatch.setattr(store, "release", flaky_release)
    sweep_id, raised = _submit_and_tick(coordinator, tiny_spec, ConnectionError)
    assert raised == [refused] and failed == {"submit": 1, "release": 1}
    assert not dispatcher.recovery.leases_to_release
    rows = store.trials(sweep_id, limit=None)
    assert {r.status for r in rows} == {"completed"}
    # every attempt counted, the released one too (not charged to the retries)
    assert all(r.attempts == len(store.attempts(r.id)) for r in rows)
    # both trials leased in the refused tick were released, the second never submitted
    assert len(_released_then_trained(store, rows)) == 2


def test_a_lease_committed_unanswered_goes_back_to_pending(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """PostgreSQL restarted during a lease's COMMIT (benchmarks/chaos.py
    --pg-restarts-mid-write): the lease committed but its answer was lost with the
    connection, so the tick raised. Its trials ran under this coordinator's lease with no
    task, and the sweep never completed until a coordinator restart; a later tick gives them
    back, their attempt not charged, and each trains once."""
    tiny_spec.update(name="unanswered-lease", max_concurrent=2, reuse=False)
    coordinator = Coordinator(get_settings())
    store = coordinator.store
    coordinator.start(background=False)
    real_lease, unanswered = store.lease_pending, []

    def committed_unanswered(*args, **kwargs):  # the first lease that takes trials
        got = real_lease(*args, **kwargs)
        if got and not unanswered:
            unanswered.extend(t.id for t in got)
            raise _outage("COMMIT")
        return got

    monkeypatch.setattr(store, "lease_pending", committed_unanswered)
    sweep_id, raised = _submit_and_tick(coordinator, tiny_spec, OperationalError)
    assert len(raised) == 1 and unanswered
    rows = store.trials(sweep_id, limit=None)
    assert {r.status for r in rows} == {"completed"}
    assert all(r.attempts == len(store.attempts(r.id)) for r in rows)
    assert sorted(_released_then_trained(store, rows)) == sorted(unanswered)


def test_packs_leased_before_a_failed_lease_go_back_to_pending(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """A tick leases each pack in its own transaction; when the database fails the second
    lease, the pack leased before it (no task yet) goes back to pending, its attempt not
    counted, rather than staying 'running' with no task until the coordinator restarts."""
    tiny_spec.update(name="half-leased", max_concurrent=2, reuse=False)
    tiny_spec["grid"]["lrs"] = [2**-8, 2**-7, 2**-6, 2**-5]
    tiny_spec["resources"] = {"cpus": 1, "pack": 2}
    coordinator = Coordinator(get_settings())
    store, dispatcher = coordinator.store, coordinator.dispatcher
    coordinator.start(background=False)
    from hptransfer.coordinator.ray_runner import ClusterCapacity

    monkeypatch.setattr(dispatcher.ray_runner, "capacity",  # two packs a tick
                        lambda: ClusterCapacity({"CPU": 2.0}, ray.nodes))
    real_lease, leases = store.lease_pending, []

    def flaky_lease(*args, **kwargs):  # the second lease of the first tick fails
        leases.append(kwargs.get("ids"))
        if len(leases) == 2:
            raise _outage("UPDATE trials")
        return real_lease(*args, **kwargs)

    monkeypatch.setattr(store, "lease_pending", flaky_lease)
    sweep_id, raised = _submit_and_tick(coordinator, tiny_spec, OperationalError)
    assert len(raised) == 1 and len(leases[0]) == 2
    assert not dispatcher.recovery.leases_to_release
    rows = store.trials(sweep_id, limit=None)
    assert {r.status for r in rows} == {"completed"}
    # every attempt counted, the released one too (not charged to the retries)
    assert all(r.attempts == len(store.attempts(r.id)) for r in rows)
    # the pack leased before the failure was released, then leased and trained again
    assert sorted(_released_then_trained(store, rows)) == sorted(leases[0])


def test_an_asked_trial_reused_while_the_database_fails_is_still_told(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """An asked trial whose row reuses an identical earlier result never runs, so it is told
    at once; when the database fails just after the row was added (reading it back), a
    later tick tells it, and the sweep completes with no Optuna trial left RUNNING."""
    settings, coordinator = _one_at_a_time_optuna(tiny_spec, "reused-untold")
    tiny_spec["reuse"] = True
    store = coordinator.store
    coordinator.start(background=False)
    real_add, real_get = store.add_trial, store.get_trial
    failing = {"armed": False, "failed": 0}

    def add_trial(*args, **kwargs):
        trial_id = real_add(*args, **kwargs)
        failing["armed"] = failing["failed"] == 0
        return trial_id

    def get_trial(*args, **kwargs):  # the read right after the first add fails
        if failing["armed"]:
            failing.update(armed=False, failed=1)
            raise _outage("SELECT trials")
        return real_get(*args, **kwargs)

    sweep_ids, raised = [], []
    try:
        for second in (False, True):  # the second, identical sweep reuses every result
            if second:
                monkeypatch.setattr(store, "add_trial", add_trial)
                monkeypatch.setattr(store, "get_trial", get_trial)
            sweep_ids.append(coordinator.submit(tiny_spec)["id"])
            raised += _tick_until_completed(coordinator, sweep_ids[-1], OperationalError, 180)
    finally:
        coordinator.stop()
    assert failing["failed"] == 1 and len(raised) == 1
    rows = store.trials(sweep_ids[1], limit=None)
    assert len(rows) == 3 and all(r.reused for r in rows)
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url)
               if sweep_ids[1] in n]
    study = optuna.load_study(study_name=name, storage=settings.optuna_url)
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    assert states == ["COMPLETE"] * 3, states


def test_an_optuna_storage_outage_holds_up_only_the_optuna_sweeps(
        hpt_home, ray_cluster, tiny_spec, tmp_path, caplog):
    """Optuna's storage (its own database, `chattr +i` here) fails while an Optuna sweep's
    trial trains, seen through the API: the trial's result is stored and its tell waits, and
    so do the sweep's next asks (its listing says why, /health names the failure), while a
    grid sweep submitted meanwhile runs to completion. Once the storage answers, every result
    is told once and the Optuna sweep completes. The first failed tell used to abort every
    tick before results were collected: no sweep advanced until Optuna's storage was back."""
    from fastapi.testclient import TestClient

    from hptransfer.api.app import create_app

    if not immutable_supported(tmp_path):
        pytest.skip("needs chattr +i (root on ext4/xfs) to make the database unwritable")
    settings = get_settings()
    searched = dict(tiny_spec, name="optuna-outage", max_concurrent=1, reuse=False,
                    search={"method": "optuna", "sampler": "tpe", "n_trials": 3},
                    resources={"cpus": 1, "pack": 1},
                    budget={"steps": 150, "batch_size": 4})
    # the storage fails once the first trial is leased (asked, and not yet told): waiting to
    # see it train left a fast host a fraction of a second before its 150 steps ended
    gridded = dict(tiny_spec, name="grid-during-outage", reuse=False)
    caplog.set_level(logging.INFO, logger="hptransfer.coordinator.dispatch")
    storage = [Path(settings.home) / "optuna.db"]

    def dispatcher_check() -> dict:
        (check,) = [c for c in api.get("/health").json()["components"]
                    if c["name"] == "dispatcher"]
        return check

    with TestClient(create_app(settings)) as api:
        store, dispatcher = api.app.state.coordinator.store, api.app.state.coordinator.dispatcher
        locked = False
        try:
            optuna_id = api.post("/sweeps", json=searched).json()["id"]
            wait_for(lambda: dispatcher.in_flight, 120, "the first Optuna trial's lease")
            assert chattr("+i", storage)
            locked = True
            grid_id = api.post("/sweeps", json=gridded).json()["id"]
            wait_for(lambda: api.get(f"/sweeps/{grid_id}").json()["status"] == "completed",
                     120, "the grid sweep to complete while Optuna's storage fails")
            wait_for(lambda: store.status_counts(optuna_id).get("completed") == 1, 120,
                     "the Optuna trial's result to be stored")
            waiting = wait_for(lambda: api.get(f"/sweeps/{optuna_id}").json()["waiting_for"],
                               60, "the Optuna sweep to say why it waits")
            assert "Optuna's storage is failing" in waiting
            (first,) = store.trials(optuna_id, limit=None)
            follow_ups = dispatcher.recovery.pending_follow_ups
            assert first.id in follow_ups and follow_ups[first.id].tell  # not yet told
            check = dispatcher_check()
            assert not check["ok"] and "Optuna's storage failing" in check["detail"], check
            assert not dispatcher.last_error  # the ticks themselves go on
            assert chattr("-i", storage)
            locked = False
            wait_for(lambda: api.get(f"/sweeps/{optuna_id}").json()["status"] == "completed",
                     180, "the Optuna sweep to complete once its storage answers")
            assert dispatcher_check()["ok"]
        finally:
            if locked:
                chattr("-i", storage)
    assert {r.status for r in store.trials(grid_id, limit=None)} == {"completed"}
    rows = store.trials(optuna_id, limit=None)
    assert len(rows) == 3 and {r.status for r in rows} == {"completed"}
    assert not dispatcher.recovery.pending_follow_ups
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if optuna_id in n]
    told = {t.number: t for t in optuna.load_study(
        study_name=name, storage=settings.optuna_url).get_trials(deepcopy=False)}
    assert sorted(told) == sorted(r.optuna_trial_number for r in rows)
    for row in rows:
        assert told[row.optuna_trial_number].state == optuna.trial.TrialState.COMPLETE
        assert told[row.optuna_trial_number].value == pytest.approx(row.final_val_loss,
                                                                    rel=1e-12)
    # one line when Optuna's storage starts failing, one when it answers; the ticks never failed
    lines = [r.getMessage() for r in caplog.records if r.name == "hptransfer.coordinator.dispatch"]
    assert sum("Optuna's storage failing" in m for m in lines) == 1, lines
    assert sum("Optuna's storage recovered" in m for m in lines) == 1, lines
    assert not any("dispatch failing" in m for m in lines), lines


def test_a_stored_sweep_that_no_longer_validates_fails_and_others_go_on(
        hpt_home, ray_cluster, tiny_spec):
    coordinator = Coordinator(get_settings())
    good = dict(tiny_spec, name="good")
    # stored as an older version (or a direct write) left it: trials planned, spec invalid now
    bad_spec = load_spec(dict(tiny_spec, name="bad"))
    stored = bad_spec.model_dump(mode="json")
    stored["grid"]["widths"] = [48]  # not a multiple of head_dim 32
    bad_id = coordinator.store.create_sweep(
        name="bad", spec=stored, spec_hash="x", search="grid", planned=plan_sweep(bad_spec),
        reuse=False, max_concurrent=2)
    run_sweep(coordinator, good, 180)
    bad = coordinator.store.get_sweep(bad_id)
    assert bad.status == "failed"
    assert "stored spec is invalid" in bad.error and "grid.widths" in bad.error
    assert set(coordinator.store.status_counts(bad_id).items()) >= {("cancelled", 3)}
    summary = coordinator.summary(bad_id)  # the listing still answers for it
    assert summary["done"] == summary["total"] == 3


def _gated_board() -> type:
    """The real progress board, answering drains only once opened."""
    import threading

    from hptransfer.coordinator.progress import ProgressBoard

    class GatedBoard(ProgressBoard):
        def __init__(self) -> None:
            super().__init__()
            self._gate = threading.Event()

        def open(self) -> None:
            self._gate.set()

        def drain(self):  # noqa: ANN202
            self._gate.wait()
            return super().drain()

    return GatedBoard


def test_a_progress_board_that_does_not_answer_holds_up_no_tick_and_is_heard_later(
        hpt_home, ray_cluster):
    """The live-metrics board is a Ray actor; one being restarted (its node lost, or killed by
    Ray's OOM monitor) answers late. Dispatch ticks go on without it meanwhile (they used to
    block 10 s each, and the late answer was dropped), and its answer is used when it comes."""
    from types import SimpleNamespace

    from hptransfer.coordinator.ray_runner import InFlight

    dispatcher = Coordinator(get_settings()).dispatcher
    dispatcher.start(background=False)
    dispatcher.mirror = None
    board = ray.remote(num_cpus=0, max_concurrency=4)(_gated_board()).remote()
    dispatcher.ray_runner.progress_board = board
    try:
        ray.get(board.report.remote("t1", {"step": 7}))  # a worker's report
        dispatcher.in_flight["t1"] = InFlight(
            trial=SimpleNamespace(optuna_trial_number=None), ref=None, cpus=1, gpus=0)
        for _ in range(3):  # unanswered: each tick goes on
            dispatcher.ray_runner.relay_progress()
        assert dispatcher.in_flight["t1"].last_step == 0
        ray.get(board.open.remote())
        wait_for(lambda: dispatcher.ray_runner.relay_progress() or
                 dispatcher.in_flight["t1"].last_step == 7, 30, "the late answer to be used")
    finally:
        ray.kill(board)


def test_an_idle_coordinator_calls_the_board_once_to_empty_it_then_not_every_tick(
        hpt_home, ray_cluster, tiny_spec):
    """With nothing in flight a tick drained the board anyway, five times a second for the
    coordinator's whole life. Now one drain takes what a lost attempt may have left there,
    and the board is not called again until a trial is submitted, even one that ends (lost)
    before any drain answered while it ran."""
    from types import SimpleNamespace

    from hptransfer.coordinator.progress import ProgressBoard

    class CountingBoard(ProgressBoard):
        def drains(self) -> int:
            return self._drains

    coordinator = Coordinator(get_settings())
    dispatcher = coordinator.dispatcher
    dispatcher.start(background=False)
    dispatcher.mirror = None
    runner = dispatcher.ray_runner
    board = ray.remote(num_cpus=0)(CountingBoard).remote()
    runner.progress_board = board
    tiny_spec.update(name="idle-board", reuse=False)
    sweep_id = coordinator.submit(tiny_spec)["id"]
    trials = coordinator.store.lease_pending(dispatcher.owner, 2, sweep_id=sweep_id)

    class Started:  # Ray's side of a submission; this test needs only its bookkeeping
        def options(self, **_options):
            return SimpleNamespace(remote=lambda *args: "task-ref")

    runner.run_trial = Started()

    def drains_in_ticks(n: int) -> int:
        before = ray.get(board.drains.remote())
        for _ in range(n):
            runner.relay_progress()
            while runner.drain_pending():  # a drain slower than the poll: its answer taken
                runner.relay_progress()
        return ray.get(board.drains.remote()) - before

    try:
        ray.get(board.report.remote("lost", {"step": 7}))  # what a lost attempt left
        assert drains_in_ticks(5) == 1
        assert ray.get(board.drain.remote()) == ({}, {})  # that one drain took it
        runner.submit(load_spec(tiny_spec), [trials[0]])
        assert drains_in_ticks(3) == 3  # a trial runs: every tick
        del dispatcher.in_flight[trials[0].id]
        assert drains_in_ticks(5) == 1  # it ended: once more, then quiet
        runner.submit(load_spec(tiny_spec), [trials[1]])
        del dispatcher.in_flight[trials[1].id]  # ended before any tick drained
        assert drains_in_ticks(5) == 1
    finally:
        ray.kill(board)
        dispatcher.stop()


def test_live_points_of_a_lost_attempt_never_reach_its_retry(hpt_home, ray_cluster, tiny_spec):
    """A drain answered late can hold the points of an attempt that was lost meanwhile and
    whose trial was leased and submitted again: they are not the retry's, so neither its
    MLflow run nor Optuna's pruner gets them; the retry's own points, drained later, do."""
    from types import SimpleNamespace

    coordinator = Coordinator(get_settings())
    dispatcher = coordinator.dispatcher
    dispatcher.start(background=False)
    dispatcher.mirror = None
    board = ray.remote(num_cpus=0, max_concurrency=4)(_gated_board()).remote()
    dispatcher.ray_runner.progress_board = board
    tiny_spec.update(name="late-points", reuse=False)
    sweep_id = coordinator.submit(tiny_spec)["id"]
    (trial,) = coordinator.store.lease_pending(dispatcher.owner, 1, sweep_id=sweep_id)

    class Started:  # Ray's side of a submission; this test needs only its bookkeeping
        def options(self, **_options):
            return SimpleNamespace(remote=lambda *args: "task-ref")

    dispatcher.ray_runner.run_trial = Started()
    try:
        ray.get(board.report.remote(trial.id, {"step": 7}))  # the lost attempt's last point
        dispatcher.ray_runner.relay_progress()  # a drain sent, unanswered
        dispatcher.ray_runner.submit(load_spec(tiny_spec), [trial])  # the retry starts
        ray.get(board.open.remote())
        while dispatcher.ray_runner.drain_pending():  # the late answer comes and is handled
            dispatcher.ray_runner.relay_progress()
        assert dispatcher.in_flight[trial.id].last_step == 0
        ray.get(board.report.remote(trial.id, {"step": 3}))  # the retry's own point
        dispatcher.ray_runner.relay_progress()
        assert dispatcher.in_flight[trial.id].last_step == 3
    finally:
        ray.kill(board)


def test_cancelling_an_optuna_sweep_tells_its_asked_trials_fail(hpt_home, ray_cluster,
                                                                 tiny_spec):
    """Trials asked of Optuna but not yet leased are cancelled with their sweep; their Optuna
    trials used to stay RUNNING in the study for good (a study in Optuna's dashboard that
    never ends). The next tick tells them FAIL."""
    settings, coordinator = _one_at_a_time_optuna(tiny_spec, "cancel-asked")
    store, dispatcher = coordinator.store, coordinator.dispatcher
    coordinator.start(background=False)
    try:
        sweep_id = coordinator.submit(tiny_spec)["id"]
        sweep = store.get_sweep(sweep_id)
        dispatcher.optuna_asker.ask(sweep, load_spec(sweep.spec), 1)  # asked; the lease comes next
        asked = store.count_trials(sweep_id, status="pending")
        assert asked >= 1
        coordinator.cancel(sweep_id)
        dispatcher.run_once()
    finally:
        coordinator.stop()
    assert store.count_trials(sweep_id, status="cancelled") == asked
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    study = optuna.load_study(study_name=name, storage=settings.optuna_url)
    assert [t.state.name for t in study.get_trials(deepcopy=False)] == ["FAIL"] * asked


def test_a_coordinator_starts_while_optunas_database_server_is_down(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    """Opening Optuna's storage connects; it was opened when the dispatcher was built, so
    `hpt serve` with HPT_OPTUNA_URL on a database server that was down failed to start at
    all. Now it starts, grid sweeps run, and the failure shows in /health, masked."""
    monkeypatch.setenv("HPT_OPTUNA_URL", "postgresql+psycopg://hpt:opt#S3cret@127.0.0.1:1/o")
    coordinator = Coordinator(get_settings())
    dispatcher = coordinator.dispatcher
    try:
        coordinator.start(background=False)
        sweep_id = coordinator.submit(dict(tiny_spec, name="grid-without-optuna"))["id"]
        searched = coordinator.submit(dict(tiny_spec, name="optuna-waits", reuse=False, search={
            "method": "optuna", "sampler": "tpe", "n_trials": 2}))["id"]
        deadline = time.monotonic() + 120
        while (coordinator.store.get_sweep(sweep_id).status != "completed"
               and time.monotonic() < deadline):
            dispatcher.run_once()
            time.sleep(0.05)
        assert coordinator.store.get_sweep(sweep_id).status == "completed"
        assert "127.0.0.1" in dispatcher.optuna_storage.error  # connection refused
        assert "Optuna's storage is failing" in dispatcher.waiting[searched]
    finally:
        coordinator.stop()
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        health = api.get("/health")
    optuna = [c for c in health.json()["components"] if c["name"] == "optuna"]
    assert optuna and not optuna[0]["ok"] and "unreachable" in optuna[0]["detail"]
    assert "S3cret" not in health.text
