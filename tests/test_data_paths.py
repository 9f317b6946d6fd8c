"""Resolving a sweep's `data.source` (hptransfer/data/paths.py, shards.py) through the API:
globs cost a bounded amount of work however many ``**`` they repeat, odd sources get a 422
that says what to fix (never a 500), and a directory source has the glob's caps."""

from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient

from hptransfer.api import create_app
from hptransfer.config import get_settings
from hptransfer.data import DataError
from hptransfer.data import paths as data_paths
from hptransfer.data.shards import resolve_shard_paths
from hptransfer.spec.data import MAX_SOURCE_CHARS


@pytest.fixture
def client(hpt_home):
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def root(hpt_home) -> Path:
    return hpt_home / "data"


def write_shard(path: Path, n: int = 50_000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 256, n).astype("<u2").tofile(path)
    return path


def post(client, tiny_spec, source: str):
    spec = {**tiny_spec, "data": {"source": source, "vocab_size": 256, "val_tokens": 1024}}
    return client.post("/sweeps", json=spec)


def source_error(r) -> str:
    """The one error message of a 422 that blames data.source."""
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == ["data.source"], r.text
    return errors[0]["message"]


def count_matches(monkeypatch, pattern: str, limit: int) -> list[str]:
    """The names compared with the pattern part `pattern` (an AssertionError past `limit`
    comparisons, so a matcher that backtracks fails at once rather than after hours)."""
    seen: list[str] = []
    real = fnmatch.fnmatchcase

    def counting(name: str, pat: str) -> bool:
        if pat == pattern:
            seen.append(name)
            assert len(seen) <= limit, f"{len(seen)} comparisons with {pat!r} already"
        return real(name, pat)

    monkeypatch.setattr(fnmatch, "fnmatchcase", counting)
    return seen


# ---- repeated `**`: work bounded by the tree, not by the pattern's repeats ---------------

def test_repeated_double_stars_compare_each_name_once(client, tiny_spec, root, monkeypatch):
    write_shard(root / "fineweb" / "train" / "shard_000.bin")
    write_shard(root / "a" / "b" / "c" / "d" / "e" / "f" / "x.bin")
    prefix, suffix = f"{root}/", "*.zzz"
    repeats = (MAX_SOURCE_CHARS - len(prefix) - len(suffix)) // 3  # as many as fit
    source = prefix + "**/" * repeats + suffix
    assert repeats > 1000 and len(source) <= MAX_SOURCE_CHARS
    compared = count_matches(monkeypatch, "*.zzz", limit=1000)
    message = source_error(post(client, tiny_spec, source))
    assert "matched no files" in message
    # 10 directories and 2 files below the root: each name is compared once with `*.zzz`
    assert sorted(compared) == sorted(["fineweb", "train", "shard_000.bin", "a", "b", "c",
                                       "d", "e", "f", "x.bin"])


def test_repeated_double_stars_still_match_what_one_matches(client, tiny_spec, root):
    write_shard(root / "fineweb" / "train" / "shard_000.bin")
    source = f"{root}/" + "**/" * 300 + "shard_*.bin"
    r = post(client, tiny_spec, source)
    assert r.status_code == 201, r.text


TREE = ("a.bin", "b.txt", "d/c.bin", "d/e/f.bin", "d/e/g/h.bin", ".hidden/g.bin", "d/.h.bin",
        "d/.hd/i.bin", "e/d/j.bin")
PATTERNS = ("*.bin", "**/*.bin", "**/**/*.bin", "**/**/**", "d/**/**/*.bin", "**/d/**/*.bin",
            "**/e/**/**/*.bin", "*/*/*.bin", "**/*/**/*.bin", "**/.h.bin", "d/.*/*.bin",
            ".hidden/**/*.bin", "**/.hd/*.bin", "?/**/?.bin", "[de]/**/[!c].bin", "**/g/**")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_bounded_glob_matches_like_glob_with_repeated_double_stars(tmp_path, pattern):
    for rel in TREE:
        write_shard(tmp_path / rel, n=2)
    full = str(tmp_path / pattern)
    # glob lists a file once per way its `**`s can split the path: compare the sets
    expected = sorted({Path(p) for p in glob.glob(full, recursive=True) if os.path.isfile(p)})
    assert expected, pattern
    assert data_paths.bounded_glob(full, [tmp_path]) == expected


def test_glob_time_cap_holds_inside_one_directory(tmp_path, monkeypatch):
    """The time cap is checked while names are matched, not only between directories: here
    every name comparison takes a (simulated) second, in a single directory."""
    for i in range(20):
        write_shard(tmp_path / f"s{i:02d}.bin", n=2)
    compared = count_matches(monkeypatch, "s*.bin", limit=1000)
    monkeypatch.setattr(data_paths, "time", SimpleNamespace(monotonic=lambda: len(compared)))
    assert data_paths.GLOB_TIME_LIMIT_S == 5.0
    with pytest.raises(DataError, match="too many files .* or 5 s"):
        data_paths.bounded_glob(str(tmp_path / "s*.bin"), [tmp_path])
    assert len(compared) <= 7  # stopped once past the cap, not after all 20 names


# ---- odd sources: a 422 naming data.source, never a 500 ----------------------------------

@pytest.mark.parametrize("make_source, expect", [
    (lambda root: f"{root}/*/..", "contains no .bin shards"),  # the glob part went with `..`
    (lambda root: f"{root}/[/..", "contains no .bin shards"),
    (lambda root: "*/..", "not inside the server's data roots"),
    (lambda root: f"{root}/" + "a" * 300 + ".bin", "cannot be read (File name too long)"),
    (lambda root: f"{root}/" + "a" * 300 + "/x.bin", "cannot be read (File name too long)"),
    (lambda root: f"{root}/x\x01.bin", "control character '\\x01'"),
    (lambda root: f"{root}/x\n*.bin", "control character '\\n'"),
    (lambda root: f"{root}/x\x7f.bin", "control character '\\x7f'"),
    (lambda root: f"{root}/x\x00.bin", "NUL"),  # the spec's own check, or the data layer's
], ids=["glob-dotdot", "bracket-dotdot", "relative-glob-dotdot", "long-name", "long-dir",
        "ctrl-a", "newline-glob", "del", "nul"])
def test_odd_sources_are_a_422_that_says_what_to_fix(client, tiny_spec, root, make_source,
                                                     expect):
    write_shard(root / "sub" / "a.bin")
    message = source_error(post(client, tiny_spec, make_source(root)))
    if expect == "NUL":
        assert "NUL" in message or "control character" in message, message
    else:
        assert expect in message, message
    assert client.get("/sweeps").json() == []


def test_a_glob_that_dotdot_cancels_reads_the_directory_it_names(client, tiny_spec, root):
    write_shard(root / "ok" / "a.bin")
    (root / "ok" / "inner").mkdir()
    r = post(client, tiny_spec, f"{root}/ok/*/..")
    assert r.status_code == 201, r.text


def test_resolving_a_source_with_a_nul_is_a_data_error(root):
    write_shard(root / "a.bin")
    for source in (f"{root}/\x00.bin", "\x00*", f"{root}/*\x00.bin"):
        with pytest.raises(DataError, match="control character"):
            resolve_shard_paths(source, [root])
    assert not data_paths.inside(Path(f"{root}/\x00"), [root])


def test_a_glob_matching_a_dangling_link_reads_only_the_files(client, tiny_spec, root):
    write_shard(root / "d" / "a.bin")
    (root / "d" / "gone.bin").symlink_to(root / "d" / "missing")
    r = post(client, tiny_spec, f"{root}/d/*.bin")
    assert r.status_code == 201, r.text


# ---- a directory source: the glob's caps on shards and entries ---------------------------

def test_directory_source_is_capped_like_a_glob(client, tiny_spec, root, monkeypatch):
    monkeypatch.setattr(data_paths, "MAX_GLOB_MATCHES", 3)
    for i in range(3):
        write_shard(root / "three" / f"s{i}.bin")
        write_shard(root / "four" / f"s{i}.bin")
    write_shard(root / "four" / "s3.bin")
    assert post(client, tiny_spec, str(root / "three")).status_code == 201
    message = source_error(post(client, tiny_spec, str(root / "four")))
    assert "holds more than 3 .bin files" in message, message
    assert source_error(post(client, tiny_spec, str(root / "four" / "*.bin"))).endswith(
        "narrow the pattern")  # the glob's own cap, for comparison


def test_directory_source_caps_the_entries_it_looks_at(client, tiny_spec, root, monkeypatch):
    monkeypatch.setattr(data_paths, "MAX_GLOB_ENTRIES", 5)
    write_shard(root / "many" / "s.bin")
    for i in range(5):
        (root / "many" / f"note{i}.txt").write_text("x")
    message = source_error(post(client, tiny_spec, str(root / "many")))
    assert "looks at too many files (limit 5 entries" in message, message
    (root / "many" / "note0.txt").unlink()
    assert post(client, tiny_spec, str(root / "many")).status_code == 201


def _submitted_trial(client, tiny_spec, source: str):
    """A sweep submitted through the API; its first trial as the dispatcher leases it."""
    from hptransfer.store.store import Store

    r = post(client, tiny_spec, source)
    assert r.status_code == 201, r.text
    store = Store(get_settings().database_url)
    (trial,) = store.lease_pending("me", 1, sweep_id=r.json()["id"])
    store.close()
    return trial


def test_the_worker_refuses_a_source_that_left_the_roots_after_submit(client, root, tiny_spec,
                                                                     tmp_path):
    from hptransfer.workers.trainer import run_trial

    write_shard(root / "corpus" / "a.bin")
    trial = _submitted_trial(client, tiny_spec, str(root / "corpus"))
    private = write_shard(tmp_path / "private" / "a.bin").parent
    (root / "corpus" / "a.bin").unlink()
    (root / "corpus").rmdir()
    os.symlink(private, root / "corpus")  # swapped after the submit-time check
    roots = [str(r) for r in get_settings().data_roots]
    result = run_trial(trial.spec, roots=roots, data_hash=trial.data_hash)
    assert result.status == "failed" and "data roots" in result.error, result.error
    assert result.steps == 0 and result.curve == []


def test_the_worker_refuses_data_that_changed_since_submit(client, root, tiny_spec):
    from hptransfer.workers.packed import run_trials
    from hptransfer.workers.trainer import run_trial

    write_shard(root / "shards" / "a.bin")
    trial = _submitted_trial(client, tiny_spec, str(root / "shards"))
    roots = [str(r) for r in get_settings().data_roots]
    spec = {**trial.spec, "budget": {"steps": 2}}
    assert run_trial(spec, roots=roots, data_hash=trial.data_hash).status == "completed"
    write_shard(root / "shards" / "b.bin")  # a shard directory still being written
    result = run_trial(spec, roots=roots, data_hash=trial.data_hash)
    assert result.status == "failed", result.status
    assert "the data changed since the sweep was submitted" in result.error
    packed = run_trials([spec, {**spec, "seed": 1}], roots=roots, data_hash=trial.data_hash)
    assert [r.status for r in packed] == ["failed", "failed"]
    assert run_trial(spec).status == "completed"  # a local run of one's own: no guard
