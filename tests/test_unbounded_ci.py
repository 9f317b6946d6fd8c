"""An unbounded CI (Fieller's interval for η* when the loss curvature is within the seed
noise: an infinite endpoint) through the REST fits endpoint: each endpoint is JSON null,
never a string "inf", a bare Infinity or an LR of 0, and the row says why."""

from __future__ import annotations

import json
import math

from fastapi.testclient import TestClient
from test_study import study_dict

from hptransfer.analysis import optimal_lr
from hptransfer.api.app import create_app
from hptransfer.config import get_settings
from hptransfer.coordinator.plan import plan_sweep
from hptransfer.coordinator.study import initial_state
from hptransfer.spec import load_spec
from hptransfer.store.store import Store

SD = 0.1  # the seeds' spread at every LR


def loss(lr: float, seed: int) -> float:
    """A parabola centred on 2^-8, far flatter than the seed noise can resolve (curvature
    0.01 per octave², Fieller's bound needs about 0.34·SD with 3 seeds at 5 LRs), the seeds'
    means on it exactly (offsets +SD, 0, -SD, alternating in sign from LR to LR)."""
    x = math.log2(lr) + 8
    return 3.0 + 0.01 * x**2 + SD * (1 - seed) * (-1) ** round(x)


def test_an_unbounded_eta_ci_is_null_with_its_reason_through_the_fits_endpoint(hpt_home):
    d = study_dict(tune={})
    d["grid"]["seeds"] = [0, 1, 2]
    spec = load_spec(d)
    store = Store(get_settings().database_url)
    store.migrate()
    tune = plan_sweep(spec)
    sid = store.create_sweep("unbounded", spec.model_dump(mode="json"), "h", "grid", tune,
                             study=initial_state(spec, len(tune)), reuse=False)
    for t in store.lease_pending("me", 100, sweep_id=sid):
        store.finish_trial(t.id, "completed", {"final_val_loss": loss(t.lr, t.seed)})
    # the fit itself: a vertex inside the LRs, a CI infinite on both sides
    fit = optimal_lr(store.results_frame(sid).drop(columns=["stage"]), bootstrap=0)
    assert set(fit.shapes["log2_ci_low"]) == {-math.inf}
    assert set(fit.shapes["log2_ci_high"]) == {math.inf}
    assert (abs(fit.shapes["log2_lr_opt"] + 8) < 1e-6).all()

    with TestClient(create_app(get_settings())) as api:
        r = api.get(f"/sweeps/{sid}/fits", params={"bootstrap": 0})
    store.close()
    assert r.status_code == 200, r.text
    body = json.loads(r.text, parse_constant=lambda c: (_ for _ in ()).throw(
        AssertionError(f"{c} in the JSON")))  # Infinity, -Infinity, NaN are not JSON
    assert "inf" not in json.dumps(body["tables"]["optimal_lr"]).replace(
        "informative", "").lower()
    for row in body["tables"]["optimal_lr"]:
        for key in ("lr_ci_low", "lr_ci_high", "log2_ci_low", "log2_ci_high",
                    "ci_half_log2"):
            assert row[key] is None, (key, row[key])
        assert row["lr_opt"] == 2.0**-8 and row["reliable"] is False
        assert row["reason"]  # not reliable, and why
    for head in body["headline"]["eta_star"]:
        assert head["log2_ci_low"] is None and head["log2_ci_high"] is None
        assert head["no_ci"].startswith("η*'s CI is unbounded")
        assert head["reliable"] is False and head["reason"]
    assert "CI unbounded" in body["text"] and "2^-inf" not in body["text"]
