"""A study whose tune target is adding trials, its coordinator (`hpt serve`, with its Ray
cluster and workers) SIGKILLed while the added trials run, and a new `hpt serve` on the same
home: the study finishes with every planned trial trained once (the orphans once more),
nothing planned twice, each added trial with the reason it was added for, and the report's
target section counting what was spent. (test_study_targets.py has the same windows through
the store and the dispatcher's ticks; this is the real processes.)"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from conftest import TINY_SPEC
from test_resilience import servers  # noqa: F401  (the fixture)
from waiting import wait_for

from hptransfer.client import Client
from hptransfer.store.store import Store

CAP = 4  # max_extra_trials: round 1 adds one seed at the 3 LRs, round 2 the one left


def target_study() -> dict[str, Any]:
    """One arm, three LRs two octaves apart with η* inside (about 2^-6 at 60 steps), one
    seed: the tune target cannot be met without added seeds (one seed measures no noise)."""
    spec = copy.deepcopy(TINY_SPEC)
    spec.update(name="target-restart", max_concurrent=2, retries=1, reuse=False)
    spec["grid"]["lrs"] = {"log2_min": -8, "log2_max": -4, "step": 2}
    spec["budget"] = {"steps": 60, "batch_size": 4}  # ~1 s a trial on an idle core
    spec["fixed"]["eval_every"] = 30
    spec["resources"] = {"cpus": 1, "gpus": 0, "pack": 1}  # one trial a task: some finish
    spec["stages"] = {"tune": {"extend": 0, "target": {"eta_ci_log2": 0.25},
                               "max_extra_trials": CAP}}
    return spec


def _round(reason: str) -> int:
    return int(re.match(r"target stages\.tune\.eta_ci_log2 round (\d+): ", reason)[1])


@pytest.mark.slow
def test_a_coordinator_killed_mid_extension_finishes_the_round_once(hpt_home, servers):  # noqa: F811
    first = servers(hpt_home)
    with Client(first.url) as c:
        sweep_id = c.submit(target_study())["id"]
    store = Store(f"sqlite:///{hpt_home}/hpt.db")

    def mid_extension() -> bool:
        added = [t.status for t in store.trials(sweep_id, limit=None) if t.reason]
        return "running" in added

    def where() -> str:  # what the study had reached, for a timeout's message
        rows = [(t.idx, t.status, t.attempts, bool(t.reason))
                for t in store.trials(sweep_id, limit=None)]
        study = store.get_sweep(sweep_id).study
        return (f"an added trial running; trials (idx, status, attempts, added): {rows}; "
                f"targets: {study.get('targets')}\n{first.log_tail()}")

    wait_for(mid_extension, 180, where, poll=0.05)
    first.kill()
    before = {t.id: t for t in store.trials(sweep_id, limit=None)}
    added_before = {t.id: t for t in before.values() if t.reason}
    orphans = {tid for tid, t in before.items() if t.status == "running"}
    assert orphans & set(added_before), "the kill came while no added trial ran"
    book_before = store.get_sweep(sweep_id).study["targets"]["tune"]
    assert book_before["spent"] == len(added_before) and not book_before["final"]

    second = servers(hpt_home, port=first.port)
    with Client(second.url) as c:
        final = c.wait(sweep_id, poll=0.3, timeout=240, progress=False)
        fits = c.fits_raw(sweep_id, bootstrap=0)
    rows = store.trials(sweep_id, limit=None)
    sweep = store.get_sweep(sweep_id)
    store.close()

    # the study finishes; no trial lost: every planned row trained to a result
    assert final["status"] == "completed", second.log_tail()
    assert sweep.study["done"] and sweep.n_trials == len(rows)
    assert [t.idx for t in rows] == list(range(len(rows)))
    assert all(t.status == "completed" and t.final_val_loss is not None
               or t.status == "diverged" for t in rows), [(t.idx, t.status) for t in rows]
    # none repeated: the rows from before the kill are the same rows, and each ran once
    # (an orphan once more: its attempt died with the coordinator)
    by_id = {t.id: t for t in rows}
    assert set(before) <= set(by_id)
    for t in rows:
        assert t.attempts == (2 if t.id in orphans else 1), (t.idx, t.attempts, t.reason)
        if t.id in before and before[t.id].status == "completed":
            assert (t.finished_at, t.final_val_loss) == (before[t.id].finished_at,
                                                         before[t.id].final_val_loss)
    added = [t for t in rows if t.reason]
    keys = [(t.arm, t.width, t.depth, t.lr, t.seed) for t in added]
    assert len(set(keys)) == len(keys), keys
    assert len({t.idx for t in added}) == len(added)
    assert len({t.content_hash for t in rows}) == len(rows)
    # the added trials keep their reasons; each round planned once, in one block of rows
    for tid, old in added_before.items():
        assert by_id[tid].reason == old.reason
    rounds = [_round(t.reason) for t in added]
    assert rounds == sorted(rounds) and set(rounds) == set(range(1, max(rounds) + 1))
    book = sweep.study["targets"]["tune"]
    assert book["rounds"] == max(rounds) and book["final"]
    target_rounds = [s for s in sweep.study["stages"] if s.get("target")]
    assert [s["n_trials"] for s in target_rounds] == [rounds.count(r) for r in
                                                      range(1, max(rounds) + 1)]
    # what was spent: the ledger, the report's target section and its text count the rows
    assert book["spent"] == len(added) <= CAP
    (reported,) = fits["targets"]
    assert reported["stage"] == "tune" and reported["spent"] == len(added)
    assert reported["rounds"] == max(rounds) and reported["max_extra_trials"] == CAP
    assert (f"spent {len(added)} of {CAP} extra trials in {max(rounds)} round(s)"
            in fits["text"])
