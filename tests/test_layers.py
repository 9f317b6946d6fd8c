"""The package's floors: each folder imports only folders on floors below it, and no two
modules import each other in a circle (function-local imports included: a late import still
ties the two). A new arrow that runs up fails here with the modules that draw it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hptransfer"

# ground floor first; a top-level module counts as a unit of its own
FLOORS: list[set[str]] = [
    {"contracts", "redaction", "backoff", "jsonsafe", "models", "sockets"},
    {"config"},
    {"analysis", "spec"},
    {"data", "store", "client"},
    {"workers", "tracking", "coordcheck"},
    {"coordinator"},
    {"dashboards"},
    {"api"},
    {"demo"},
    {"cli"},
]
FLOOR_OF = {unit: n for n, units in enumerate(FLOORS) for unit in units}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The hptransfer modules `path` imports, relative imports resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hptransfer."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("hptransfer."):
                continue
            found.add(target)
            # `from package import module` names a module too
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts}
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_folder_imports_only_floors_below_it():
    graph = _graph()
    units = {_unit(m) for m in graph} - {"__init__"}
    assert units <= set(FLOOR_OF), f"give these a floor: {sorted(units - set(FLOOR_OF))}"
    upward = sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets
        if _unit(a) != "__init__" and _unit(b) not in ("__init__", _unit(a))
        and FLOOR_OF[_unit(b)] >= FLOOR_OF[_unit(a)])
    assert not upward, "imports that run up or sideways:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph = _graph()
    # a package's __init__ only hands its modules' names on: its arrows are the modules'
    graph = {m: {t for t in ts if not PACKAGE.joinpath(*t.split(".")[1:], "__init__.py").exists()}
             for m, ts in graph.items()}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)
