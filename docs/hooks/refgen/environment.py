"""The environment-variable reference: `hptransfer.config.ENVIRONMENT`, plus the knobs the
shell scripts read (their `${HPT_X:-default}` expansions)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .schema import cell

ROOT = Path(__file__).resolve().parents[3]
_SCRIPT_VARIABLE = re.compile(r"\$\{(HPT_[A-Z0-9_]+):-([^}]*)\}")
_PACKAGE_VARIABLE = re.compile(r"^HPT_[A-Z0-9_]+$")


def package_variables() -> dict[str, set[str]]:
    """Every HPT_* name written as a string in the package, with the files that name it."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "hptransfer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and _PACKAGE_VARIABLE.match(node.value):
                found.setdefault(node.value, set()).add(str(path.relative_to(ROOT)))
    return found


def unlisted_variables() -> list[str]:
    """A problem line for each HPT_* variable the package reads that ENVIRONMENT lacks."""
    from hptransfer.config import ENVIRONMENT

    listed = {v.name for v in ENVIRONMENT}
    return [f"{name} (read in {', '.join(sorted(files))}) is missing from "
            "hptransfer.config.ENVIRONMENT: add it there to document it"
            for name, files in sorted(package_variables().items()) if name not in listed]


def script_variables() -> list[tuple[str, str, str]]:
    """(variable, default, script) for each `${HPT_X:-default}` in scripts/*.sh."""
    rows: dict[str, tuple[str, str, str]] = {}
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        for name, default in _SCRIPT_VARIABLE.findall(path.read_text(encoding="utf-8")):
            rows.setdefault(name, (name, default, path.name))
    return list(rows.values())


def page() -> str:
    from hptransfer.config import ENVIRONMENT

    out = ["# Environment variables", "",
           "Generated from `hptransfer.config.ENVIRONMENT` at every docs build. An empty "
           "variable counts as unset; a value that cannot be used is one clear error when the "
           "server, the demo or `hpt doctor` starts.", "",
           "| variable | default | meaning |", "|---|---|---|"]
    out += [f"| `{v.name}` | {cell(v.default)} | {cell(v.meaning)} |" for v in ENVIRONMENT]
    out += ["", "## Read by the scripts", "",
            "The shell scripts under `scripts/` take these (found in their "
            "`${VAR:-default}` expansions):", "",
            "| variable | default | script |", "|---|---|---|"]
    out += [f"| `{name}` | `{cell(default)}` | `scripts/{script}` |"
            for name, default, script in script_variables()]
    return "\n".join(out) + "\n"
