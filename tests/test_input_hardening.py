"""Hostile and careless input (issue 8): each case is refused with a 4xx that says why, and
nothing is stored. Real app, real SQLite, no dispatcher (nothing here needs to train)."""

from __future__ import annotations

import glob
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from hptransfer.api import create_app
from hptransfer.cli import main as hpt_main
from hptransfer.config import get_settings
from hptransfer.data import DataError

JSON = {"content-type": "application/json"}


@pytest.fixture
def client(hpt_home):
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c


def post_text(client, text: str, headers=JSON):
    return client.post("/sweeps", content=text, headers=headers)


def fields(r) -> list[str]:
    return [e["field"] for e in r.json()["errors"]]


def nothing_stored(client) -> bool:
    r = client.get("/sweeps")
    return r.status_code == 200 and r.json() == []


# ---- case 1: JSON Infinity is refused, so no unlistable sweep is stored ------------------

def test_case1_infinity_budget_is_422_and_listing_stays_up(client, tiny_spec):
    tiny_spec["budget"] = {"tokens_per_param": 1.0, "batch_size": 4}
    text = json.dumps(tiny_spec).replace('"tokens_per_param": 1.0', '"tokens_per_param": Infinity')
    r = post_text(client, text)
    assert r.status_code == 422 and fields(r) == ["budget.tokens_per_param"], r.text
    assert "Infinity" in r.json()["error"]
    assert nothing_stored(client)
    assert client.get("/dashboards").status_code == 200


@pytest.mark.parametrize("constant", ["NaN", "-Infinity"])
def test_case1_non_finite_json_anywhere(client, tiny_spec, constant):
    for path, marker in ((("fixed", "grad_clip"), 0.5), (("grid", "lrs"), [0.5])):
        spec = json.loads(json.dumps(tiny_spec))
        spec[path[0]][path[1]] = marker
        text = json.dumps(spec).replace("0.5", constant)
        r = post_text(client, text)
        assert r.status_code == 422, r.text
        assert fields(r) == [".".join(path) + ("[0]" if path[1] == "lrs" else "")]
    assert nothing_stored(client)


# ---- case 8: sizes without bounds; resource admission -------------------------------------

@pytest.mark.parametrize(("section", "key", "value", "field", "bound"), [
    ("grid", "widths", [2**30], "grid.widths[0]", "65536"),
    ("grid", "depths", [10**6], "grid.depths[0]", "1024"),
    ("fixed", "seq_len", 10**9, "fixed.seq_len", "1048576"),
    ("budget", "batch_size", 10**9, "budget.batch_size", "1048576"),
    ("budget", "steps", 10**12, "budget.steps", "1000000000"),
])
def test_case8_sizes_have_named_bounds(client, tiny_spec, section, key, value, field, bound):
    tiny_spec[section][key] = value
    r = client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422 and fields(r) == [field], r.text
    assert bound in r.json()["error"]
    assert nothing_stored(client)


@pytest.mark.parametrize("arm", [{"arch": "gpt", "parameterization": "completep"},
                                 {"arch": "ngpt", "parameterization": "ngpt"}])
def test_an_odd_head_size_with_rope_is_refused_at_submit(client, tiny_spec, arm):
    # RoPE rotates pairs of a head's dimensions: at head_dim 1 (or 3 at width 33) every trial
    # failed in its first forward, after the sweep was stored (and a GPU plan priced it)
    tiny_spec["arms"] = [arm]
    tiny_spec["fixed"]["head_dim"] = 1
    r = client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422, r.text
    assert "head_dim must be even with position 'rope'" in r.text
    assert client.get("/sweeps").json() == []
    # ALiBi has no pairs: an odd head size trains
    tiny_spec["arms"] = [{"arch": "gpt", "parameterization": "completep",
                          "arch_options": {"position": "alibi"}}]
    assert client.post("/sweeps", json=tiny_spec).status_code == 201


def test_case8_tokens_and_grad_clip(client, tiny_spec):
    tiny_spec["budget"] = {"tokens": 10**30, "batch_size": 4}
    r = client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422 and fields(r) == ["budget.tokens"]
    tiny_spec["budget"] = {"steps": 10, "batch_size": 4}
    text = json.dumps({**tiny_spec, "fixed": {**tiny_spec["fixed"], "grad_clip": 1.5}})
    r = post_text(client, text.replace("1.5", "Infinity"))
    assert r.status_code == 422 and fields(r) == ["fixed.grad_clip"]
    assert nothing_stored(client)


def test_case8_admission_refuses_a_trial_no_worker_can_hold(client, tiny_spec):
    # In bounds, but ~52 trillion parameters: 16 bytes each is far past any machine.
    tiny_spec["grid"].update(widths=[65536], depths=[1024])
    tiny_spec["fixed"].update(head_dim=64)
    r = client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422 and fields(r) == ["grid"], r.text
    message = r.json()["error"]
    assert "width 65536, depth 1024" in message and "GB" in message
    assert "more memory than" in message and "parameters" in message
    assert nothing_stored(client)


@pytest.mark.parametrize("stage", ["transfer", "check", "aspect_ratio"])
def test_admission_refuses_a_study_stage_shape_no_worker_can_hold(client, stage):
    # The grid (the tune stage) is tiny; one later stage asks for ~17 trillion parameters.
    from test_study import study_dict

    spec = study_dict()
    huge = {"width": 65536, "depth": 320}
    if stage == "check":
        spec["stages"]["check"] = {"shapes": [huge]}
    else:
        spec["stages"][stage]["shapes"].append(huge)
    r = client.post("/sweeps", json=spec)
    assert r.status_code == 422, r.text
    # one problem per arm, each under the field that asks for the shape
    assert fields(r) == [f"stages.{stage}.shapes"] * 2, r.text
    assert "width 65536, depth 320" in r.json()["error"]
    assert nothing_stored(client)


def test_admission_prices_every_shape_a_study_trains_at_its_own_budget():
    from test_study import study_dict

    from hptransfer.coordinator.admission import trial_costs
    from hptransfer.models import build_model
    from hptransfer.spec import load_spec

    spec = study_dict()  # budget: 10 steps of 4 x 32 tokens
    spec["stages"]["transfer"]["shapes"].append({"width": 64, "depth": 2,
                                                 "tokens_per_param": 40})
    spec["stages"]["aspect_ratio"]["tokens_per_param"] = 20
    costs = trial_costs(load_spec(spec))

    def tokens(tokens_per_param: float, width: int, depth: int) -> int:
        # non-embedding parameters counted on the real model (torch), not by flops.py
        model = build_model("gpt", width, depth, "sp", head_dim=32, max_seq_len=32).model
        params = sum(p.numel() for n, p in model.named_parameters()
                     if not n.startswith(("embed.", "unembed.")))
        per_step = 4 * 32
        return per_step * math.ceil(tokens_per_param * params / per_step)

    for arm in ("gpt/sp", "gpt/completep"):
        priced = sorted((c.field, c.width, c.depth, c.tokens) for c in costs if c.arm == arm)
        assert priced == sorted([
            ("grid", 32, 1, 1280),  # the tune stage
            ("stages.transfer.shapes", 32, 2, 1280), ("stages.transfer.shapes", 64, 2, 1280),
            ("stages.transfer.shapes", 64, 2, tokens(40, 64, 2)),
            ("stages.aspect_ratio.shapes", 32, 8, tokens(20, 32, 8)),
            ("stages.aspect_ratio.shapes", 64, 2, tokens(20, 64, 2)),
            ("stages.aspect_ratio.shapes", 96, 1, tokens(20, 96, 1)),
            ("stages.aspect_ratio.shapes", 32, 7, tokens(20, 32, 7)),
        ])  # the check shape (64x2 at the sweep's budget, by default) is the ladder's


def test_admission_prices_the_small_head_paths_saved_softmax(tiny_spec):
    # head_dim 8 at seq 32: attention keeps its (batch x heads, T, T) softmax for backward
    import torch

    from hptransfer.coordinator.admission import trial_costs
    from hptransfer.models.layers import uses_small_head_path
    from hptransfer.spec import load_spec

    assert uses_small_head_path(torch.empty(4, 4, 32, 8))
    tiny_spec["fixed"]["head_dim"] = 8
    (cost,) = trial_costs(load_spec(tiny_spec))
    heads, t = 32 // 8, 32
    # 4 bytes x batch 4 x seq 32 x (depth 1 x (width 32 x 17 + heads 4 x T 32) + the final
    # norm's width 32 + 3 x 256)
    assert cost.activation_bytes == 4 * 4 * t * (32 * 17 + heads * t + 32 + 3 * 256)


def test_micro_batches_bound_the_admitted_activations(client, tiny_spec):
    from hptransfer.coordinator.admission import trial_costs
    from hptransfer.spec import load_spec

    (whole,) = trial_costs(load_spec(tiny_spec))
    tiny_spec["fixed"]["micro_batch_size"] = 1  # of batch 4: a quarter of the activations
    (micro,) = trial_costs(load_spec(tiny_spec))
    assert micro.activation_bytes == whole.activation_bytes / 4
    assert (micro.state_bytes, micro.tokens) == (whole.state_bytes, whole.tokens)
    tiny_spec["fixed"]["micro_batch_size"] = 0
    r = client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422 and fields(r) == ["fixed.micro_batch_size"], r.text
    assert nothing_stored(client)


def test_admission_caps_from_the_environment(hpt_home, monkeypatch, tiny_spec):
    monkeypatch.setenv("HPT_MAX_TRIAL_FLOPS", "1e6")
    monkeypatch.setenv("HPT_MAX_TRIAL_MEMORY_GB", "1e-4")  # 100 kB
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        r = c.post("/sweeps", json=tiny_spec)
        assert r.status_code == 422 and fields(r) == ["grid", "grid"], r.text
        message = r.json()["error"]
        assert "HPT_MAX_TRIAL_FLOPS=1e+06" in message
        assert "HPT_MAX_TRIAL_MEMORY_GB=0.0001" in message
        assert c.get("/sweeps").json() == []


def test_admission_memory_estimate_against_an_independent_count(tiny_spec):
    # 16 bytes per parameter, the parameters counted on the real model (torch), not flops.py
    from hptransfer.coordinator.admission import trial_costs
    from hptransfer.models import build_model
    from hptransfer.spec import load_spec

    spec = load_spec(tiny_spec)
    (cost,) = trial_costs(spec)
    built = build_model("gpt", 32, 1, "completep", head_dim=32, vocab_size=256,
                        max_seq_len=32, base_width=32, base_depth=1)
    n = sum(p.numel() for p in built.model.parameters())
    assert cost.params == n and cost.state_bytes == 16 * n
    # activations: 4 bytes x batch 4 x seq 32 x (depth 1 x width 32 x (9 + 2*4) + the final
    # norm's width 32 + 3 x 256)
    assert cost.activation_bytes == 4 * 4 * 32 * (32 * 17 + 32 + 3 * 256)
    assert cost.tokens == 10 * 4 * 32


# ---- case 9: request size, string lengths, tag counts ------------------------------------

def test_case9_body_size_cap(hpt_home, monkeypatch, tiny_spec):
    monkeypatch.setenv("HPT_MAX_REQUEST_BYTES", "4096")
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        r = c.post("/sweeps", json={**tiny_spec, "description": "x" * 5000})
        assert r.status_code == 413, r.text
        # in JSON as every error, with the limit and its setting (was text: Content Too Large)
        assert r.json()["error"].startswith("the request body is over the server's limit of "
                                            "4096 bytes (HPT_MAX_REQUEST_BYTES)")
        # a body streamed without a Content-Length is counted as it arrives
        body = json.dumps({**tiny_spec, "description": "x" * 5000}).encode()
        chunks = (body[i:i + 1000] for i in range(0, len(body), 1000))
        r = c.post("/sweeps", content=chunks, headers=JSON)
        assert r.status_code == 413 and "HPT_MAX_REQUEST_BYTES" in r.json()["error"], r.text
        assert c.get("/sweeps").json() == []
        assert c.post("/sweeps", json=tiny_spec).status_code == 201


@pytest.mark.parametrize(("extra", "field"), [
    ({"description": "x" * 10_001}, "description"),
    ({"name": "x" * 101}, "name"),
    ({"tags": {f"k{i}": "v" for i in range(65)}}, "tags"),
    ({"tags": {"k": "v" * 1025}}, "tags.k"),
    ({"tags": {"k" * 129: "v"}}, "tags"),
])
def test_case9_string_and_tag_caps(client, tiny_spec, extra, field):
    r = client.post("/sweeps", json={**tiny_spec, **extra})
    assert r.status_code == 422, r.text
    assert any(f == field or f.startswith(field + ".") for f in fields(r)), fields(r)
    assert nothing_stored(client)


# ---- cases 6 and 7: data roots, bounded globs ----------------------------------------------

def write_shard(path: Path, n: int = 50_000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 256, n).astype("<u2").tofile(path)
    return path


def shard_spec(tiny_spec, source: str) -> dict:
    return {**tiny_spec, "data": {"source": source, "vocab_size": 256, "val_tokens": 1024}}


def test_case6_sources_outside_the_data_roots_reveal_nothing(client, hpt_home, tiny_spec,
                                                              tmp_path):
    outside = write_shard(tmp_path / "outside" / "secret.bin")
    root = hpt_home / "data"
    write_shard(root / "ok" / "a.bin")
    (root / "link.bin").symlink_to(outside)
    (root / "dirlinks").mkdir()
    (root / "dirlinks" / "x.bin").symlink_to(outside)
    (root / "dangling.bin").symlink_to(tmp_path / "outside" / "missing.bin")
    refused = [
        str(outside),                                   # exists, outside
        str(tmp_path / "outside" / "missing.bin"),      # missing, outside
        "/etc/passwd",
        str(root / ".." / "data" / ".." / ".." / "outside" / "secret.bin"),  # `..` escape
        "~/secret.bin",                                 # `~` is not the server's home
    ]
    messages = []
    for source in refused:
        r = client.post("/sweeps", json=shard_spec(tiny_spec, source))
        assert r.status_code == 422 and fields(r) == ["data.source"], (source, r.text)
        messages.append(r.json()["errors"][0]["message"].replace(repr(source), "SOURCE"))
    assert len(set(messages)) == 1, messages  # existing or not: the same words
    assert "not inside the server's data roots" in messages[0]
    # links under a root that lead out are named (they are under the roots), never where
    # they lead, and the same words whether their target exists or not
    links = {str(root / "link.bin"): root / "link.bin",
             str(root / "dangling.bin"): root / "dangling.bin",
             str(root / "dirlinks"): root / "dirlinks" / "x.bin",  # a shard in it links out
             str(root / "*.bin"): root / "dangling.bin"}
    messages = []
    for source, named in links.items():
        r = client.post("/sweeps", json=shard_spec(tiny_spec, source))
        assert r.status_code == 422 and fields(r) == ["data.source"], (source, r.text)
        message = r.json()["errors"][0]["message"]
        assert str(tmp_path / "outside") not in message, message
        assert message.startswith(f"data source {source!r}: {str(named)!r} is a symbolic"), message
        messages.append(message.rsplit(f"{str(named)!r}", 1)[1])
    assert len(set(messages)) == 1, messages
    assert "is a symbolic link (or a path through one) that leads outside" in messages[0]
    assert nothing_stored(client)
    r = client.post("/sweeps", json=shard_spec(tiny_spec, str(root / "ok" / "a.bin")))
    assert r.status_code == 201, r.text
    r = client.post("/sweeps", json=shard_spec(tiny_spec, str(root / "ok" / "*.bin")))
    assert r.status_code == 201, r.text


def test_extra_data_roots_from_the_environment(hpt_home, monkeypatch, tiny_spec, tmp_path):
    shard = write_shard(tmp_path / "corpora" / "a.bin")
    monkeypatch.setenv("HPT_DATA_ROOTS", str(tmp_path / "corpora"))
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        assert c.post("/sweeps", json=shard_spec(tiny_spec, str(shard))).status_code == 201


def test_case7_recursive_glob_outside_roots_is_refused_without_walking(client, tiny_spec):
    r = client.post("/sweeps", json=shard_spec(tiny_spec, "/usr/lib/**/*.zzz"))
    assert r.status_code == 422 and fields(r) == ["data.source"]
    assert "not inside the server's data roots" in r.json()["error"]


def test_a_plan_refuses_the_data_a_submit_would(client, hpt_home, tiny_spec, tmp_path):
    """`POST /sweeps?dry_run=true` (`hpt plan`) priced a spec whose data the submit then
    refused: a source outside the data roots, a pattern matching nothing."""
    root = hpt_home / "data"
    write_shard(root / "ok" / "a.bin")
    for source, says in (("/etc/passwd", "not inside the server's data roots"),
                         (str(root / ".." / ".." / "etc" / "*.bin"), "not inside"),
                         (str(root / "**" / "*.zzz"), "matched no files"),
                         (str(tmp_path / "outside" / "*.bin"), "not inside")):
        r = client.post("/sweeps", json=shard_spec(tiny_spec, source),
                        params={"dry_run": "true"})
        assert r.status_code == 422 and fields(r) == ["data.source"], (source, r.text)
        assert says in r.json()["error"], (source, r.text)
    r = client.post("/sweeps", json=shard_spec(tiny_spec, str(root / "ok" / "*.bin")),
                    params={"dry_run": "true"})
    assert r.status_code == 200 and r.json()["total"]["trials"] == 3, r.text
    assert nothing_stored(client)


def test_bounded_glob_matches_like_glob_and_stops_at_its_caps(tmp_path, monkeypatch):
    from hptransfer.data import paths as data_paths

    for rel in ("a.bin", "b.txt", "d/c.bin", "d/e/f.bin", ".hidden/g.bin", "d/.h.bin"):
        write_shard(tmp_path / rel, n=2)
    for pattern in ("*.bin", "**/*.bin", "d/*.bin", "d/**/*.bin", "*/*.bin", "?.bin"):
        full = str(tmp_path / pattern)
        expected = sorted(Path(p) for p in glob.glob(full, recursive=True) if os.path.isfile(p))
        assert data_paths.bounded_glob(full, [tmp_path]) == expected, pattern
    monkeypatch.setattr(data_paths, "MAX_GLOB_MATCHES", 2)
    with pytest.raises(DataError, match="matches more than 2 files"):
        data_paths.bounded_glob(str(tmp_path / "**/*.bin"), [tmp_path])
    monkeypatch.setattr(data_paths, "MAX_GLOB_ENTRIES", 3)
    with pytest.raises(DataError, match="too many files"):
        data_paths.bounded_glob(str(tmp_path / "**/*.zzz"), [tmp_path])


# ---- cases 11, 12, 13: network safety ------------------------------------------------------

def test_case11_public_bind_without_token_refuses_to_start(hpt_home, capsys):
    assert hpt_main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--insecure" in capsys.readouterr().err


def test_case12_cross_site_simple_requests_cannot_mutate(client, tiny_spec):
    sweep = client.post("/sweeps", json=tiny_spec).json()
    cancel = f"/sweeps/{sweep['id']}/cancel"
    for headers in ({}, {"content-type": "text/plain"},
                    {"content-type": "application/x-www-form-urlencoded"}):
        assert client.post(cancel, headers=headers).status_code == 415
        r = client.post("/sweeps", content=json.dumps(tiny_spec), headers=headers)
        assert r.status_code == 415
    assert client.get(f"/sweeps/{sweep['id']}").json()["counts"].get("cancelled", 0) == 0
    assert len(client.get("/sweeps").json()) == 1
    r = client.post(cancel, json={})
    assert r.status_code == 200 and r.json()["counts"]["cancelled"] == 3


def test_a_server_token_no_client_could_send_is_refused_at_start(hpt_home, monkeypatch):
    """HTTP headers carry ASCII and `hpt` refuses to send anything else: a server holding a
    token like 'tökén' started, and no `hpt` command could ever reach it."""
    from hptransfer.config import SettingsError

    for token in ("t\u00f6k\u00e9n", "tab\there"):
        monkeypatch.setenv("HPT_API_TOKEN", token)
        with pytest.raises(SettingsError, match="HPT_API_TOKEN must be printable ASCII"):
            get_settings()


def test_case13_non_ascii_token_is_401(hpt_home, monkeypatch, tiny_spec):
    monkeypatch.setenv("HPT_API_TOKEN", "s3cret")
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        for token in ("Bearer ünïcode".encode(), b"Bearer \xff\xfe", "Bearer s3cret€".encode()):
            r = c.post("/sweeps", json=tiny_spec, headers={"authorization": token})
            assert r.status_code == 401, (token, r.text)
        assert c.post("/sweeps", json=tiny_spec,
                      headers={"authorization": "Bearer s3cret"}).status_code == 201


@pytest.mark.parametrize(("path", "params"), [
    ("/sweeps", {"offset": 2**63}),
    ("/sweeps", {"offset": 10**30}),
    ("/sweeps/x/trials", {"width": 99999999999999999999999}),
    ("/sweeps/x/trials", {"depth": 2**64}),
    ("/sweeps/x/trials", {"offset": 2**63}),
])
def test_case13_huge_integer_query_parameters_are_422(client, path, params):
    r = client.get(path, params=params)
    assert r.status_code == 422, r.text
    assert list(params)[0] in r.json()["error"]


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"name": ' + "9" * 5000 + "}"])
def test_json_too_deep_or_too_long_to_read_says_so(client, body):
    r = post_text(client, body)
    assert r.status_code == 400 and "nested too deeply, or an integer of more than 4300" in \
        r.json()["error"], r.text
    assert nothing_stored(client)


def test_a_body_not_in_utf8_is_called_that(client):
    """It was answered "nested too deeply, or an integer of more than 4300 digits"."""
    r = client.post("/sweeps", content=b'{"name": "\xff\xfe"}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "the body is not UTF-8 text; send the JSON encoded as UTF-8"
    assert nothing_stored(client)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_sigma_query_is_called_that(client, tiny_spec, value):
    sweep_id = client.post("/sweeps", json=tiny_spec).json()["id"]
    r = client.get(f"/sweeps/{sweep_id}/trials", params={"sigma_base": value})
    assert r.status_code == 422 and "sigma_base: Input should be a finite number" in r.text
    for name in ("cpus", "gpus"):  # a plan's cluster: "less than or equal to 1000000" before
        r = client.post("/sweeps", json=tiny_spec, params={"dry_run": "true", name: value})
        assert r.status_code == 422 and f"{name}: Input should be a finite number" in r.text


# ---- NUL characters and repeated keys: refused up front, on either database ---------------

@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_db_client(request, hpt_home, monkeypatch):
    """The API on SQLite, or on PostgreSQL (which refuses NUL in text: a 500 before)."""
    if request.param == "postgresql":
        monkeypatch.setenv("HPT_DATABASE_URL", request.getfixturevalue("postgres_schema_url"))
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize(("method", "url"), [
    ("GET", "/sweeps/%00"), ("GET", "/sweeps/a%00b/trials"), ("GET", "/sweeps/%00/fits"),
    ("GET", "/dashboards/sweeps/%00"), ("GET", "/sweeps/abc/trials?arm=%00"),
    ("GET", "/sweeps?status=%00"), ("POST", "/sweeps/%00/cancel"),
])
def test_a_nul_in_the_url_is_400(any_db_client, method, url):
    r = any_db_client.request(method, url, json={} if method == "POST" else None)
    assert r.status_code == 400, r.text
    assert "NUL character (%00)" in r.json()["error"]


@pytest.mark.parametrize("query", ["status=completed&status=failed", "limit=1&limit=2",
                                   "arm=a&stage=tune&arm=b"])
def test_a_query_parameter_given_twice_is_422_naming_it(any_db_client, query):
    # FastAPI kept the last value: two statuses listed one, silently
    r = any_db_client.get(f"/sweeps/abc/trials?{query}")
    assert r.status_code == 422, r.text
    repeated = query.split("=")[0]
    assert r.json()["errors"] == [{"field": f"query.{repeated}",
                                   "message": "given more than once"}]
    assert f"'{repeated}' is given more than once" in r.json()["error"]
    assert any_db_client.get("/sweeps?limit=1&offset=0").status_code == 200  # once each


def test_an_unknown_id_is_not_echoed_whole(any_db_client):
    r = any_db_client.get("/sweeps/" + "x" * 5000)
    assert r.status_code == 404 and len(r.text) < 400, r.text[:500]


def test_a_nul_in_a_spec_text_is_422_naming_its_fields(any_db_client, tiny_spec):
    tiny_spec["arms"][0]["label"] = "lab\u0000el"
    tiny_spec["tags"] = {"team\u0000": "x", "run": "a\u0000b"}
    r = any_db_client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422, r.text
    assert sorted(fields(r)) == ["arms[0].label", "tags", "tags.run"], r.json()
    assert "NUL character" in r.json()["error"]
    assert nothing_stored(any_db_client)


def test_a_key_given_twice_is_422(client, tiny_spec):
    text = json.dumps(tiny_spec)
    r = post_text(client, text.replace('"name": "tiny"', '"name": "tiny", "name": "other"'))
    assert r.status_code == 422, r.text
    assert "duplicate key 'name'" in r.json()["error"]
    assert nothing_stored(client)
    nested = text.replace('"steps": 10', '"steps": 10, "steps": 20')
    assert "duplicate key 'steps'" in post_text(client, nested).json()["error"]


def test_a_body_of_many_unknown_keys_gets_a_bounded_answer(client, tiny_spec):
    """Each unknown key's error lists the allowed fields: 100,000 of them in 0.9 MB got a
    35 MB 422 (38x the body) after seconds of CPU. The first 50 are listed, the rest
    counted."""
    from hptransfer.spec.errors import MAX_SPEC_ERRORS

    body = json.dumps({**tiny_spec, **{str(i): 0 for i in range(60_000)}})
    r = post_text(client, body)
    assert r.status_code == 422
    errors = r.json()["errors"]
    assert len(errors) == MAX_SPEC_ERRORS + 1 and len(r.content) < len(body) / 10
    assert errors[0]["field"] == "0" and "unknown field '0'" in errors[0]["message"]
    assert errors[-1] == {"field": "", "message": "... and 59950 more errors: fix these first"}
    assert nothing_stored(client)


def test_one_huge_unknown_key_is_echoed_shortened(client, tiny_spec):
    """A 700 KB key was echoed in its field, its message and the summary: a 2.2 MB 422."""
    key = "k" * 700_000
    r = post_text(client, json.dumps({**tiny_spec, key: 0}))
    assert r.status_code == 422 and len(r.content) < 2_000, len(r.content)
    (err,) = r.json()["errors"]
    assert err["field"] == "k" * 60 + "..." and "unknown field 'kkkk" in err["message"]
    assert nothing_stored(client)


def test_malformed_json_says_where_not_a_field(client):
    r = post_text(client, '{"name": "x",\n bad}')
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["field"] == "body"
    assert err["message"].startswith("invalid JSON at character 15: Expecting property name")
    assert nothing_stored(client)


@pytest.mark.parametrize("method, path, allowed", [
    ("PUT", "/sweeps", "GET, HEAD, POST"), ("DELETE", "/sweeps", "GET, HEAD, POST"),
    ("OPTIONS", "/sweeps", "GET, HEAD, POST"), ("POST", "/health", "GET, HEAD"),
])
def test_a_405_names_every_method_the_path_serves(hpt_home, method, path, allowed):
    # Starlette named the first route that matched the path only: `Allow: POST` on /sweeps
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        r = c.request(method, path)
    assert r.status_code == 405 and r.headers["Allow"] == allowed
    assert r.json()["error"].startswith(f"{method} is not served at {path}: use ")


@pytest.mark.parametrize("path", ["/health", "/sweeps", "/dashboards",
                                  "/dashboards/static/plotly.min.js"])
def test_head_is_answered_as_get_without_the_body(hpt_home, path):
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        head, get = c.head(path), c.get(path)
    assert head.status_code == get.status_code == 200  # a 405 before
    assert head.content == b"" and head.headers["content-length"] == get.headers[
        "content-length"]
    assert head.headers["content-type"] == get.headers["content-type"]



def test_a_trailing_slash_is_served_not_redirected(client, tiny_spec):
    """Starlette answered /sweeps/ with a 307 to a URL built from the request it saw: behind
    a proxy that ends TLS, http://, and a client not following 307 lost its POST."""
    proxied = {"X-Forwarded-Proto": "https", "Host": "hpt.example"}
    r = client.post("/sweeps/", json=tiny_spec, headers=proxied, follow_redirects=False)
    assert r.status_code == 201 and "location" not in r.headers, r.text
    sweep_id = r.json()["id"]
    for path, want in ((f"/sweeps/{sweep_id}/", sweep_id), ("/sweeps/", sweep_id),
                       (f"/sweeps/{sweep_id}/trials/", sweep_id), ("/health/", None),
                       ("/dashboards/", None), ("/dashboards", None)):
        got = client.get(path, headers=proxied, follow_redirects=False)
        assert got.status_code == 200 and "location" not in got.headers, (path, got.text)
        if want is not None:
            assert want in got.text
    assert client.get("/sweeps//", follow_redirects=False).status_code == 200
    assert client.get("/nowhere/", follow_redirects=False).status_code == 404

def test_a_trial_page_leaves_the_curves_in_the_database_unless_asked(any_db_client,
                                                                    tiny_spec):
    """A curve has a point per evaluation: a page of 10 000 trials with them was hundreds
    of MB read and sent (846 kB a trial at 1000-point curves)."""
    sweep_id = any_db_client.post("/sweeps", json=tiny_spec).json()["id"]
    store = any_db_client.app.state.coordinator.store
    curve = [{"step": i, "train_loss": 5.0 - i / 1e4, "val_loss": 5.1} for i in range(1, 2001)]
    for t in store.lease_pending("me", 10, sweep_id=sweep_id):
        store.finish_trial(t.id, "completed", {"final_val_loss": 4.9, "curve": curve,
                                               "notes": ["n"], "param_table": {"g": 1}})
    url = f"/sweeps/{sweep_id}/trials"
    slim = any_db_client.get(url, params={"limit": 10_000})
    assert slim.status_code == 200 and len(slim.content) < 10_000, len(slim.content)
    for item in slim.json()["items"]:
        assert "curve" not in item["result"]  # the rest of the result is there
        assert item["result"]["notes"] == ["n"] and item["result"]["param_table"] == {"g": 1}
        assert item["final_val_loss"] == 4.9
    full = any_db_client.get(url, params={"limit": 100, "curves": "true"})
    assert [len(i["result"]["curve"]) for i in full.json()["items"]] == [2000] * 3
    too_many = any_db_client.get(url, params={"limit": 101, "curves": "true"})
    assert too_many.status_code == 422 and "at most 100 trials" in too_many.json()["error"]


def test_admission_prices_bf16_as_fp32_unless_the_trial_must_run_on_cuda(tiny_spec):
    """bf16 autocasts on CUDA only: a bf16 trial that may run on a CPU worker trains fp32
    there, and was admitted at its halved activations."""
    from hptransfer.coordinator.admission import trial_costs
    from hptransfer.spec import load_spec

    (fp32,) = trial_costs(load_spec(tiny_spec))
    costs = {}
    for device, gpus in (("cpu", 0), ("auto", 0), ("cuda", 0.5), ("auto", 0.5)):
        tiny_spec["fixed"].update(device=device, precision="bf16")
        tiny_spec["resources"] = {"cpus": 1, "gpus": gpus}
        (costs[device, gpus],) = trial_costs(load_spec(tiny_spec))
    assert {costs["cpu", 0].activation_bytes, costs["auto", 0].activation_bytes} == {
        fp32.activation_bytes}
    # on a GPU Ray gives it (device cuda, or auto with resources.gpus): bf16 activations
    assert costs["cuda", 0.5].activation_bytes == costs["auto", 0.5].activation_bytes
    assert costs["cuda", 0.5].activation_bytes < 0.8 * fp32.activation_bytes


def test_a_gpu_sweep_is_priced_against_a_gpu_not_the_cpu_nodes(client, tiny_spec,
                                                               monkeypatch):
    """A GPU sweep on a coordinator whose Ray nodes are CPU-only so far was refused against
    their RAM ("more memory than the 17.3 GB of the largest Ray worker node"), though the
    README says it waits for a GPU node; past the largest GPU it is still refused."""
    from hptransfer.coordinator import admission

    monkeypatch.setattr(admission, "largest_worker_memory",
                        lambda: (17.3e9, "the largest Ray worker node"))
    tiny_spec["fixed"].update(device="cuda", precision="bf16", head_dim=128,
                              base_width=4096, base_depth=16)
    tiny_spec["grid"].update(widths=[4096], depths=[16], lrs=[1e-3])  # ~3.2 B parameters
    tiny_spec["budget"] = {"steps": 1, "batch_size": 1}
    cpu = {"cpus": 1, "gpus": 0}
    r = client.post("/sweeps", json={**tiny_spec, "fixed": {**tiny_spec["fixed"],
                                                            "device": "auto"},
                                     "resources": cpu})
    assert r.status_code == 422 and "the 17.3 GB of the largest Ray worker node" in r.text
    tiny_spec["resources"] = {"cpus": 1, "gpus": 1}
    assert client.post("/sweeps", json=tiny_spec).status_code == 201
    tiny_spec["grid"].update(widths=[65536], depths=[1024])  # ~52 T parameters
    tiny_spec["fixed"].update(base_width=65536, base_depth=1024)
    r = client.post("/sweeps", json=tiny_spec)
    assert r.status_code == 422 and "the 192 GB of the largest GPU" in r.json()["error"], r.text


# ---- text shown elsewhere: Plotly, spreadsheets, MLflow (fourth hostile probe) -----------

@pytest.mark.parametrize(("change", "field"), [
    ({"label": '<a href="https://evil.example">click</a>'}, "arms[0].label"),  # Plotly link
    ({"label": "sp>mup"}, "arms[0].label"),
    ({"tags": {"a<b": "one", "a_b": "two"}}, "tags.a<b"),  # both would be MLflow's a_b
    ({"tags": {"team/project": "one"}}, "tags.team/project"),  # the mirror writes team_project
    ({"tags": {"..x": "one"}}, "tags...x"),
    ({"tags": {"k": "left\u202eright"}}, "tags.k"),  # a direction override
    ({"tags": {"k": "isolate\u2066d"}}, "tags.k"),
    ({"tags": {"k": "\x1b[2Jcleared"}}, "tags.k"),
])
def test_text_other_programs_would_read_as_markup_or_keys_is_refused(
        client, tiny_spec, change, field):
    spec = json.loads(json.dumps(tiny_spec))
    if "label" in change:
        spec["arms"][0]["label"] = change["label"]
    else:
        spec["tags"] = change["tags"]
    r = client.post("/sweeps", json=spec)
    assert r.status_code == 422 and fields(r) == [field], r.text
    assert nothing_stored(client)


@pytest.mark.parametrize("label", ["sp, lr=2^-6 (a-b)", "+qk_norm", "-rope", "@alice",
                                   '=HYPERLINK("x")'])  # the CSV export quotes formulas
def test_plain_labels_and_unicode_tags_are_kept(client, tiny_spec, label):
    tiny_spec["arms"][0]["label"] = label
    tiny_spec["tags"] = {"paper": "CompleteP – Dey et al.", "owner:team": "Jürgen's",
                         "note": "tuned on 2 GPUs\nsee ticket 12\tok",
                         "team": "\U0001f469\u200d\U0001f4bb ml"}  # a ZWJ emoji
    r = client.post("/sweeps?dry_run=true", json=tiny_spec)
    assert r.status_code == 200, r.text


def test_a_stored_spec_the_newer_submit_rules_refuse_is_still_read(tiny_spec):
    from test_study import study_dict

    from hptransfer.spec import SweepSpec, load_spec

    tiny_spec["arms"][0]["label"] = "<b>old</b>"
    tiny_spec["tags"] = {"a<b": "x\u202e"}
    stored = SweepSpec.model_validate(tiny_spec)  # as the store re-reads a sweep
    assert stored.arms[0].label == "<b>old</b>" and stored.tags == {"a<b": "x\u202e"}
    # a study stored before aspect_ratio shapes had to share one size (128x1 is twice 32x8)
    shapes = [{"width": 32, "depth": 8}, {"width": 64, "depth": 2}, {"width": 96, "depth": 1},
              {"width": 128, "depth": 1}]
    old = study_dict(aspect_ratio={"shapes": shapes})
    assert len(SweepSpec.model_validate(old).stages.aspect_ratio.shapes) == 4
    with pytest.raises(ValueError, match="at one size"):
        load_spec(old)  # a new submission is refused


def test_the_csv_export_quotes_cells_a_spreadsheet_would_run_as_formulas():
    import pandas as pd

    from hptransfer.cli import inert

    df = pd.DataFrame({"arm": ['=HYPERLINK("x")', "+qk_norm", "-rope", "@a", "gpt/sp"],
                       "final_val_loss": [-1.5, 2.0, 3.0, 4.0, 5.0]})
    out = inert(df)
    assert out["arm"].tolist() == ["'=HYPERLINK(\"x\")", "'+qk_norm", "'-rope", "'@a", "gpt/sp"]
    assert out["final_val_loss"].tolist() == [-1.5, 2.0, 3.0, 4.0, 5.0]  # numbers stay numbers
