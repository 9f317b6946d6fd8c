"""A page of staged studies is summarised in a constant number of SQL statements (stage
counts batched, the stored spec validated once per process), with the same per-stage
progress as a single sweep's summary."""

from __future__ import annotations

from test_listing_queries import statements
from test_study import study_dict

from hptransfer.config import get_settings
from hptransfer.coordinator.plan import plan_sweep
from hptransfer.coordinator.service import Coordinator
from hptransfer.coordinator.study import initial_state
from hptransfer.spec import load_spec


def add_studies(coordinator: Coordinator, n: int) -> list[str]:
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    return [coordinator.store.create_sweep(
        f"study-{i}", spec.model_dump(mode="json"), "h", "grid", tune, reuse=False,
        study=initial_state(spec, len(tune))) for i in range(n)]


def test_listing_studies_takes_as_many_queries_for_50_as_for_5(hpt_home) -> None:
    coordinator = Coordinator(get_settings(), dispatch=False)
    try:
        first = add_studies(coordinator, 5)
        coordinator.store.lease_pending("me", 3, sweep_id=first[0])  # not all alike
        few = statements(coordinator.store.engine, lambda: coordinator.summaries(limit=1000))
        add_studies(coordinator, 45)
        listed: list[dict] = []
        many = statements(coordinator.store.engine,
                          lambda: listed.extend(coordinator.summaries(limit=1000)))
        assert len(listed) == 50 and few == many, (few, many)
        # the batched stage counts give what one sweep's own summary gives
        one = coordinator.summary(first[0])
        (same,) = [s for s in listed if s["id"] == first[0]]
        assert same["stages"] == one["stages"] and same["total"] == one["total"]
        tune = one["stages"][0]
        assert tune["stage"] == "tune" and tune["counts"] == {"pending": 7, "running": 3}
        assert [st["planned"] for st in one["stages"]] == [True, False, False, False]
    finally:
        coordinator.store.close()
