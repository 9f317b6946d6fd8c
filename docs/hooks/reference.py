"""MkDocs hook: generates the reference pages from the code at every build.

Spec fields come from the pydantic models, the REST API from the app's OpenAPI schema, the
CLI from its argparse parser and the environment variables from `hptransfer.config`, so a
new field, route, flag or variable shows up without editing a page. A page that cannot be
generated logs a warning, which `mkdocs build --strict` turns into a failed build.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).parent))

from refgen import cli, environment, openapi, spec  # noqa: E402

log = logging.getLogger("mkdocs.hooks.reference")

# generated file (under docs/) -> function returning its text
PAGES: dict[str, Callable[[], str]] = {
    "reference/spec.md": spec.page,
    "reference/api.md": openapi.page,
    "reference/cli.md": cli.page,
    "reference/environment.md": environment.page,
    "reference/openapi.json": openapi.schema_json,
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for uri, make in PAGES.items():
        try:
            content = make()
        except Exception as exc:  # any failure must fail a strict build, saying which page
            log.warning("reference page %s could not be generated: %r", uri, exc)
            content = "{}" if uri.endswith(".json") else f"# Not generated\n\n`{exc!r}`\n"
        files.append(File.generated(config, uri, content=content))
    for problem in environment.unlisted_variables():
        log.warning(problem)
    return files
