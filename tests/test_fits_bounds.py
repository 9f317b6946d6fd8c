"""Fit reports under load: identical requests share one computation, at most MAX_COMPUTING
run at once, and past MAX_ADMITTED a request is refused with a 503 and Retry-After instead
of tying up a server thread and hundreds of MB each (bootstrap 2000 on 5000 trials: ~5 s,
~0.6 GB per report)."""

from __future__ import annotations

import copy
import threading
import time

from conftest import TINY_SPEC
from fastapi.testclient import TestClient
from waiting import wait_for

from hptransfer.api.app import create_app
from hptransfer.config import get_settings
from hptransfer.coordinator import fits
from hptransfer.coordinator.gate import Gate


def finished_sweep(store) -> str:
    from hptransfer.coordinator.plan import plan_sweep
    from hptransfer.spec import load_spec

    spec = load_spec(copy.deepcopy(TINY_SPEC))
    sweep_id = store.create_sweep("fits", spec.model_dump(mode="json"), "h", "grid",
                                  plan_sweep(spec), reuse=False)
    for t in store.lease_pending("me", 10, sweep_id=sweep_id):
        store.finish_trial(t.id, "completed", {"final_val_loss": 3.0 + t.lr})
    return sweep_id


class SlowCompute:
    """The real computation, held until `release` is set, counting how many run at once."""

    def __init__(self, monkeypatch) -> None:
        self.real, self.release = fits._compute, threading.Event()
        self.running = self.most = self.calls = 0
        self.lock = threading.Lock()
        monkeypatch.setattr(fits, "_compute", self)

    def __call__(self, *args):
        with self.lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(30)
        try:
            return self.real(*args)
        finally:
            with self.lock:
                self.running -= 1


def test_identical_requests_share_one_computation_and_distinct_ones_queue(hpt_home,
                                                                         monkeypatch):
    from hptransfer.store.store import Store

    store = Store(get_settings().database_url)
    store.migrate()
    sweep_id = finished_sweep(store)
    slow = SlowCompute(monkeypatch)
    monkeypatch.setattr(fits, "GATE", Gate(2, 8, fits.FitsBusy, fits.GATE.why))
    reports = []

    def ask(bootstrap):
        reports.append(fits.sweep_report(store, sweep_id, bootstrap, wait=True))

    threads = [threading.Thread(target=ask, args=(b,)) for b in (0, 0, 0, 0, 1, 2, 3)]
    for t in threads:
        t.start()
    wait_for(lambda: slow.running == 2, 30, "two computations")
    time.sleep(0.5)  # time for a third to start, were it let through
    assert slow.running == 2  # two computing, the rest waiting their turn
    slow.release.set()
    for t in threads:
        t.join(60)
    assert len(reports) == 7 and slow.most == 2
    assert slow.calls == 4  # bootstrap 0 once for its four requests, then 1, 2 and 3
    store.close()


def test_past_the_admitted_requests_a_fits_request_is_a_503_with_retry_after(hpt_home,
                                                                            monkeypatch):
    slow = SlowCompute(monkeypatch)
    monkeypatch.setattr(fits, "GATE", Gate(fits.MAX_COMPUTING, 1, fits.FitsBusy, fits.GATE.why))
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        sweep_id = finished_sweep(api.app.state.coordinator.store)
        first = threading.Thread(target=api.get, args=(f"/sweeps/{sweep_id}/fits",),
                                 kwargs={"params": {"bootstrap": 7}})
        first.start()
        deadline = time.time() + 30
        while slow.running == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        for path in (f"/sweeps/{sweep_id}/fits", f"/dashboards/sweeps/{sweep_id}"):
            busy = api.get(path, params={"bootstrap": 9})
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "5", busy.text
            assert "fit reports are being computed" in busy.text
        slow.release.set()
        first.join(60)
        again = api.get(f"/sweeps/{sweep_id}/fits", params={"bootstrap": 7})
        assert again.status_code == 200 and slow.calls == 1  # the first one's, cached


def test_past_the_admitted_submissions_preparing_data_a_submit_is_a_503(hpt_home,
                                                                       monkeypatch):
    """A submission prepares its data in the request thread (a BPE tokenizer trained on a
    cache miss took 5-13 s): bounded as fit reports are, so a flood of submissions with new
    tokenizer settings cannot take every core or every request thread."""
    from hptransfer.coordinator import service

    real, release, entered = service.load_dataset, threading.Event(), threading.Event()

    def slow_load(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "load_dataset", slow_load)
    monkeypatch.setattr(service, "DATA_GATE", Gate(1, 1, service.DataBusy,
                                                   service.DATA_GATE.why))
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        first: list = []
        submitting = threading.Thread(target=lambda: first.append(
            api.post("/sweeps", json={**copy.deepcopy(TINY_SPEC), "name": "first"})))
        submitting.start()
        assert entered.wait(30)
        busy = api.post("/sweeps", json={**copy.deepcopy(TINY_SPEC), "name": "second"})
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "5", busy.text
        assert "submissions are preparing their data; retry" in busy.text
        release.set()
        submitting.join(60)
        assert first[0].status_code == 201, first[0].text
        names = [s["name"] for s in api.get("/sweeps").json()]
        assert names == ["first"]  # the refused one left nothing behind


def test_a_report_whose_tables_fail_is_still_answered_with_the_failure_named():
    """A rendering bug must not hide the report: the tables' failure joins the analyses'
    failures (a dict, name -> why), and the rest of the report is served."""
    from hptransfer.analysis.report import FitReport

    class Broken(FitReport):
        def tables(self):
            raise RuntimeError("a table cannot render")

    report = Broken(bootstrap=10, seed=0)
    report.failures["frontier"] = "ValueError: not enough shapes"
    out = fits.fits_payload(report)
    assert out["failures"] == {"frontier": "ValueError: not enough shapes",
                               "tables": "RuntimeError: a table cannot render"}
    assert out["tables"] == {} and "a table cannot render" in out["text"]
