"""The docs: the MkDocs site builds with --strict and its reference pages are generated from
the code (spec fields, routes, CLI commands, environment variables); the README stays short
and free of dates and commit hashes."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# a commit hash: 7-40 hex characters with at least one letter and one digit (not a plain number)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
# pages allowed to carry dates and commits: the measurements and the changelog
DATED_PAGES = {"results.md"}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings"):
        pytest.importorskip(module)
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def page(site: Path, name: str) -> str:
    return (site / "reference" / name / "index.html").read_text(encoding="utf-8")


def test_reference_pages_are_generated_not_written() -> None:
    # they exist only in the built site: a page checked in here would hide a broken hook
    for name in ("spec", "api", "cli", "environment"):
        assert not (ROOT / "docs" / "reference" / f"{name}.md").exists()
    assert "hooks/reference.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_spec_reference_lists_every_field(site: Path) -> None:
    from hptransfer.spec import Fixed, SweepSpec

    html = page(site, "spec")
    for name in [*SweepSpec.model_fields, *Fixed.model_fields]:
        assert f"<code>{name}</code>" in html, name
    assert "micro_batch_size" in html and "65536" in html  # a field and a bound


def test_api_reference_lists_the_routes(site: Path) -> None:
    html = page(site, "api")
    assert "/sweeps" in html and "/sweeps/{sweep_id}/fits" in html
    schema = (site / "reference" / "openapi.json").read_text(encoding="utf-8")
    assert '"/sweeps/{sweep_id}/trials"' in schema


def test_cli_reference_lists_every_command(site: Path) -> None:
    from hptransfer.cli import build_parser

    html = page(site, "cli")
    commands = next(a.choices for a in build_parser()._actions if hasattr(a, "choices")
                    and isinstance(a.choices, dict))
    assert "submit" in commands
    for name in commands:
        assert f"hpt {name}" in html, name
    assert "--wait" in html


def test_environment_and_client_references(site: Path) -> None:
    from hptransfer.config import ENVIRONMENT

    html = page(site, "environment")
    for var in ENVIRONMENT:
        assert var.name in html, var.name
    assert "HPT_CLUSTER_DIR" in html  # read from the scripts
    client = page(site, "client")
    assert "fits_raw" in client and "submit" in client


def test_every_hpt_variable_is_in_the_environment_table() -> None:
    from hptransfer.config import ENVIRONMENT

    listed = {v.name for v in ENVIRONMENT}
    used = set()
    for path in (ROOT / "hptransfer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"HPT_[A-Z0-9_]+", node.value):
                used.add(node.value)
    assert used and used <= listed, sorted(used - listed)


def test_readme_is_short_and_undated() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert not DATE.search(text), DATE.search(text)
    assert not COMMIT.search(text), COMMIT.search(text)
    # the quick start's two commands, exactly
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text


def test_docs_pages_are_undated() -> None:
    pages = [p for p in (ROOT / "docs").rglob("*.md") if p.name not in DATED_PAGES]
    assert pages
    for path in pages:
        text = path.read_text(encoding="utf-8")
        assert not DATE.search(text), (path, DATE.search(text))
        assert not COMMIT.search(text), (path, COMMIT.search(text))


def test_the_patterns_catch_what_they_guard() -> None:
    assert DATE.search("on 2026-12-05") and COMMIT.search("at c4d292d")
    assert not COMMIT.search("1048576 bytes") and not COMMIT.search("a decade")
