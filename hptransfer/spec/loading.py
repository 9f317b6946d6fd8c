"""The raw data of a sweep spec: a dict as given, or read from a .yaml/.yml/.json file or from
YAML/JSON text.

Syntax errors become a SpecError naming the line and column. YAML is read strictly: a repeated
key is an error, and ``1e-3`` is a number (as in YAML 1.2), not a string.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from hptransfer.spec.text import (
    MAX_NESTING,
    NESTED_TOO_DEEPLY,
    DuplicateKey,
    load_yaml,
    looks_like_path,
    nesting_depth,
    too_many_digits,
    unique_keys,
)

from .errors import NonFiniteJSON, SpecError, error


def strict_json_loads(text: str | bytes) -> Any:
    """json.loads, but Infinity/-Infinity/NaN (which Python accepts, JSON does not) become
    values no spec field accepts, so they are refused with the field's path; and a repeated
    key is an error (DuplicateKey), as in a YAML spec."""
    try:
        return json.loads(text, parse_constant=NonFiniteJSON, object_pairs_hook=unique_keys)
    except ValueError as exc:
        raise too_many_digits(exc) or exc from None


def nul_problems(data: Any, path: str = "") -> list[dict[str, str]]:
    """Where `data` (parsed JSON/YAML) holds a NUL character, in a key or a text: nothing
    downstream can keep one (PostgreSQL's text and jsonb refuse it), so it is an error."""
    problems: list[dict[str, str]] = []
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack and len(problems) < 10:
        value, where = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                problems.append(error(where, "contains a NUL character (\\u0000): remove it"))
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and "\x00" in key:
                    problems.append(error(where, f"the key {key[:100]!r} contains a NUL character "
                                                 "(\\u0000): remove it"))
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return problems


def read_spec_data(source: dict | str | os.PathLike) -> dict:
    """The mapping of fields in `source`: a dict, a file path, or YAML/JSON text."""
    if isinstance(source, dict):
        data: Any = source
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and looks_like_path(source)):
        data = _read_file(Path(source))
    elif isinstance(source, str):
        data = _parse_text(source, where="")
    else:
        raise SpecError([error("", f"cannot load a sweep spec from {type(source).__name__}; "
                               "pass a dict, a file path, or YAML/JSON text")])
    if not isinstance(data, dict):
        raise SpecError([error("", f"a sweep spec must be a mapping of fields, "
                               f"got {type(data).__name__}")])
    if nesting_depth(data) > MAX_NESTING:
        raise SpecError([error("", NESTED_TOO_DEEPLY)])
    if problems := nul_problems(data):
        raise SpecError(problems)
    return data


def _read_file(path: Path) -> Any:
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([error("", f"file not found: {path}")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([error("", f"cannot read {path}: {exc}")]) from None
    if path.suffix.lower() == ".json":
        return _parse_json(text, where=f" in {path}")
    return _parse_yaml(text, where=f" in {path}")


def _parse_text(text: str, where: str) -> Any:
    if text.lstrip().startswith("{"):
        try:
            return _parse_json(text, where)
        except SpecError as json_error:
            try:
                return _parse_yaml(text, where)  # flow-style YAML also starts with "{"
            except SpecError:
                raise json_error from None
    return _parse_yaml(text, where)


def _parse_json(text: str, where: str) -> Any:
    try:
        return strict_json_loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError([error(
            "", f"invalid JSON{where} at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        )]) from None
    except DuplicateKey as exc:
        raise SpecError([error("", f"invalid JSON{where}: {exc}")]) from None
    except RecursionError:  # json's scanner recurses once a level
        raise SpecError([error("", f"{NESTED_TOO_DEEPLY}{where}")]) from None
    except ValueError as exc:  # too_many_digits
        raise SpecError([error("", f"{exc}{where}")]) from None


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        detail = f"{problem} ({context})" if context else problem
        raise SpecError([error("", f"invalid YAML{where}{at}: {detail}")]) from None
    except ValueError as exc:
        raise SpecError([error("", f"{exc}{where}")]) from None
