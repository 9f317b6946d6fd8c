"""The listing cache's invalidation: the app database's commit counter (a real SQLite
engine), the time limit, one build per key; and /health's probe cache."""

from __future__ import annotations

import asyncio
import threading
import time

from sqlalchemy import text

from hptransfer.api.listing import ListingCache, etag_of
from hptransfer.coordinator.health import Check, ProbeCache
from hptransfer.store.changes import CommitCounter
from hptransfer.store.engine import for_writing, make_engine


def test_commits_move_the_counter_and_reads_do_not(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    counter = CommitCounter(engine)
    with for_writing(engine).begin() as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    after_ddl = counter.value
    assert after_ddl > 0
    with engine.connect() as conn:
        conn.execute(text("SELECT * FROM t")).all()
    assert counter.value == after_ddl
    with for_writing(engine).begin() as conn:
        conn.execute(text("INSERT INTO t VALUES (1)"))
    assert counter.value > after_ddl
    with for_writing(engine).begin() as conn:  # a failed write commits nothing
        conn.execute(text("INSERT INTO t VALUES (2)"))
        conn.rollback()
    before = counter.value
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 1
    assert counter.value == before
    engine.dispose()


def test_the_cache_rebuilds_on_a_new_version_or_after_its_time_limit():
    version, builds = [0], []

    def build() -> bytes:
        builds.append(version[0])
        return f"v{version[0]}".encode()

    async def run() -> None:
        cache = ListingCache(lambda: version[0], ttl_s=1.0)  # two gets apart: never, loaded
        assert await cache.get("k", build) == b"v0"
        assert await cache.get("k", build) == b"v0"
        assert builds == [0]
        version[0] = 1
        assert await cache.get("k", build) == b"v1"
        assert await cache.get("other", build) == b"v1"
        assert builds == [0, 1, 1]
        time.sleep(1.2)  # writers in other processes: bounded by the time limit
        assert await cache.get("k", build) == b"v1"
        assert builds == [0, 1, 1, 1]

    asyncio.run(run())


def test_the_etag_follows_the_bytes_not_the_build():
    version, bodies = [0], [b"same", b"same", b"other"]

    async def run() -> list[str]:
        cache = ListingCache(lambda: version[0], ttl_s=60)
        tags = []
        for _ in bodies:
            tags.append((await cache._entry("k", lambda: bodies[version[0]])).etag)
            version[0] += 1  # every call a rebuild
        return tags

    tags = asyncio.run(run())
    assert tags[0] == tags[1] == etag_of(b"same")  # rebuilt, unchanged: a 304 stays valid
    assert tags[2] == etag_of(b"other") != tags[0]
    assert tags[0].startswith('"') and tags[0].endswith('"')  # a strong entity tag


def test_a_commit_during_a_build_makes_that_entry_stale():
    version = [0]

    def build() -> bytes:
        body = f"v{version[0]}".encode()
        version[0] += 1  # a writer commits while the listing is being built
        return body

    async def run() -> None:
        cache = ListingCache(lambda: version[0], ttl_s=60)
        assert await cache.get("k", build) == b"v0"
        assert await cache.get("k", build) == b"v1"  # rebuilt, not served stale

    asyncio.run(run())


def test_concurrent_misses_build_once():
    started, release, builds = threading.Event(), threading.Event(), []

    def build() -> bytes:
        builds.append(1)
        started.set()
        release.wait(5)
        return b"x"

    async def run() -> list[bytes]:
        cache = ListingCache(lambda: 0)
        tasks = [asyncio.create_task(cache.get("k", build)) for _ in range(8)]
        await asyncio.to_thread(started.wait, 5)
        await asyncio.sleep(0.1)
        release.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == [b"x"] * 8
    assert builds == [1]


def test_probe_cache_reuses_a_probe_within_its_time_limit():
    calls = []

    def probe() -> list[Check]:
        calls.append(1)
        return [Check("optuna", True, f"call {len(calls)}")]

    cache = ProbeCache(ttl_s=1.0)
    assert cache("optuna", probe)[0].detail == "call 1"
    assert cache("optuna", probe)[0].detail == "call 1"
    time.sleep(1.2)
    assert cache("optuna", probe)[0].detail == "call 2"


def test_relisting_a_page_of_many_studies_does_not_validate_their_specs_again(
        hpt_home, monkeypatch):
    """A page of studies (each summary needs its validated spec) larger than the spec cache
    evicted, in order, every spec the next rebuild needed: 0.6-0.9 s per rebuild of 1000."""
    from fastapi.testclient import TestClient
    from test_study import study_dict

    import hptransfer.spec.cache as cache_module
    from hptransfer.api.app import create_app
    from hptransfer.config import get_settings
    from hptransfer.coordinator.plan import plan_sweep
    from hptransfer.coordinator.study import initial_state
    from hptransfer.spec import load_spec

    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        store = api.app.state.coordinator.store
        spec = load_spec(study_dict())
        tune, raw = plan_sweep(spec), spec.model_dump(mode="json")
        for i in range(300):  # more than the cache held
            store.create_sweep(f"study-{i}", raw, "h", "grid", tune, reuse=False,
                               study=initial_state(spec, len(tune)))
        assert len(api.get("/sweeps", params={"limit": 1000}).json()) == 300
        validations = []
        real = cache_module.SweepSpec

        class Counting:
            @staticmethod
            def model_validate(data):
                validations.append(1)
                return real.model_validate(data)

        monkeypatch.setattr(cache_module, "SweepSpec", Counting)
        api.app.state.listings._entries.clear()  # what any commit to the app database does
        assert len(api.get("/sweeps", params={"limit": 1000}).json()) == 300
        assert validations == []


def test_a_listing_does_not_read_the_specs_it_drops(hpt_home):
    import copy
    import tracemalloc

    from conftest import TINY_SPEC
    from fastapi.testclient import TestClient

    from hptransfer.api.app import create_app
    from hptransfer.config import get_settings
    from hptransfer.spec import load_spec

    raw = {**copy.deepcopy(TINY_SPEC), "description": "d" * 10_000,
           "tags": {f"k{i:03d}" + "x" * 120: "v" * 1024 for i in range(64)}}
    stored = load_spec(raw).model_dump(mode="json")  # ~86 kB, the most a submit takes
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        store = api.app.state.coordinator.store
        for i in range(300):
            store.create_sweep(f"s{i}", stored, "h", "grid", [], planned_total=0)
        api.app.state.listings._entries.clear()
        tracemalloc.start()
        try:
            r = api.get("/sweeps", params={"limit": 1000})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert r.status_code == 200 and len(r.json()) == 300
    assert peak < 300 * 20_000, peak  # 56 MB when every spec was read to be dropped
