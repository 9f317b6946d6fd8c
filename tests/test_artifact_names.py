"""A sweep's artifacts stay under the artifact root whatever its name: `safe_name` never
gives `.`, `..`, an empty name or a path (a sweep named `..` wrote beside the root)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hptransfer.tracking.mirror import Mirror
from hptransfer.tracking.params import safe_name

NAMES = ["..", ".", "", "...", "../x", "a/b", "/etc", "..\\x", "x" * 200]


@pytest.mark.parametrize("name", NAMES)
def test_safe_name_is_one_plain_file_name(name):
    safe = safe_name(name)
    assert safe and safe.strip(".") and "/" not in safe and "\\" not in safe
    assert Path(safe).name == safe and len(safe) <= 89


def test_safe_name_keeps_plain_names_and_stays_injective():
    assert safe_name("cpu-small.v2") == "cpu-small.v2"
    assert len({safe_name(n) for n in NAMES + ["_", "__", "___"]}) == len(NAMES) + 3


@pytest.mark.parametrize("name", [".", "..", "...", "../.."])
def test_a_sweeps_artifacts_stay_under_the_root(tmp_path, name):
    root = tmp_path / "mlartifacts"
    mirror = SimpleNamespace(artifact_root=str(root))
    where = Path(Mirror._artifact_location(mirror, SimpleNamespace(name=name, id="abc123")))
    assert where.resolve().is_relative_to(root.resolve()) and where.parent.parent == root
