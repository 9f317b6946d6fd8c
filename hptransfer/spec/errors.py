"""SpecError, and pydantic's ValidationError turned into SpecError entries.

An entry is {"field": path, "message": text}: the path reads like the spec itself
(``grid.widths[2]``, ``arms[0].alpha``) and the message says what to fix, without pydantic's
boilerplate.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, get_args

from pydantic import BaseModel, ValidationError


class NonFiniteJSON:
    """What strict JSON parsing puts where a document says Infinity, -Infinity or NaN: no
    field accepts it, so the error names the field (Python's json would give a float)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def is_non_finite_json(value: Any) -> bool:
    return isinstance(value, NonFiniteJSON)


# Tags of the grid.lrs union; they appear in pydantic's error locations and are dropped there.
LRS_LIST, LRS_RANGE = "lr_list", "lr_log_range"


# Errors listed per spec; past these, one entry counts the rest. A body of 100,000 unknown
# keys got a 35 MB answer (each error lists the allowed fields) after 6 s of CPU.
MAX_SPEC_ERRORS = 50


class SpecError(ValueError):
    """An invalid sweep spec; `.errors` is a list of {"field": path, "message": text}, the
    first MAX_SPEC_ERRORS of them and then one that counts the rest (`more` more)."""

    def __init__(self, errors: list[dict[str, str]], more: int = 0) -> None:
        more += max(0, len(errors) - MAX_SPEC_ERRORS)
        self.errors = [{"field": e["field"], "message": e["message"]}
                       for e in errors[:MAX_SPEC_ERRORS]]
        if more:
            self.errors.append(error("", f"... and {more} more errors: fix these first"))
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(_line(e) for e in self.errors)


def error(field: str, message: str) -> dict[str, str]:
    return {"field": field, "message": message}


def _line(e: dict[str, str]) -> str:
    return f"{e['field']}: {e['message']}" if e["field"] else e["message"]


def plain_message(exc: BaseException, root: type[BaseModel]) -> str:
    """A ValidationError as 'field: message; ...' without pydantic's boilerplate."""
    if isinstance(exc, ValidationError):
        return "; ".join(_line(e) for e in spec_error(exc, root).errors)
    return str(exc)


def spec_error(exc: ValidationError, root: type[BaseModel]) -> SpecError:
    """The SpecError for `exc`: its first MAX_SPEC_ERRORS errors converted, the rest counted
    (converting each costs a lookup of the allowed fields)."""
    return SpecError(*_converted(exc, root))


def _converted(exc: ValidationError, root: type[BaseModel]) -> tuple[list[dict[str, str]], int]:
    """SpecError entries for the errors of `exc` (`root`, the model validated, lists its
    fields when a key is unknown), and how many were left unconverted past the cap."""
    out: list[dict[str, str]] = []
    errors = exc.errors()
    for done, err in enumerate(errors):
        if len(out) >= MAX_SPEC_ERRORS:
            return out, len(errors) - done
        loc, kind = tuple(err["loc"]), err["type"]
        field = _path(loc)
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):
            # Our own checks already carry field paths, relative to where they were raised.
            out.extend(error(_join(field, e["field"]), e["message"]) for e in cause.errors)
            continue
        if kind == "extra_forbidden":
            out.append(error(field, _unknown_field_message(loc, root)))
        elif kind == "missing":
            out.append(error(field, "required field is missing"))
        elif kind in ("value_error", "assertion_error") and cause is not None:
            out.append(error(field, str(cause)))
        elif kind in _TYPE_HINTS and _TYPE_HINTS[kind](err.get("input")):
            out.append(error(field, _type_message(kind, err.get("input"))))
        elif kind == "too_short" and err.get("input") in ([], {}, ""):
            out.append(error(field, "must not be empty"))
        else:
            out.append(error(field, _with_input(err["msg"], err.get("input"))))
    return out, 0


# an unknown key is echoed in the field's path, its message and the summary line: a key
# of 700 KB made a 2.2 MB error response
MAX_ECHOED_KEY = 60


def _shown_key(part: Any) -> str:
    key = str(part)
    return key if len(key) <= MAX_ECHOED_KEY else f"{key[:MAX_ECHOED_KEY]}..."


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if part in (LRS_LIST, LRS_RANGE):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{_shown_key(part)}" if out else _shown_key(part)
    return out


def _join(prefix: str, field: str) -> str:
    if not prefix:
        return field
    if not field:
        return prefix
    return prefix + field if field.startswith("[") else f"{prefix}.{field}"


def _model_at(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The spec model that holds the field at `loc` (for listing its allowed fields)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int) or part in (LRS_LIST, LRS_RANGE):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _find_model(model.model_fields[part].annotation)
    return model


def _find_model(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in get_args(tp):
        found = _find_model(arg)
        if found is not None:
            return found
    return None


def _unknown_field_message(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    name = _shown_key(loc[-1])
    model = _model_at(loc[:-1], root)
    if model is None:
        return f"unknown field {name!r}"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown field {name!r}{hint} (allowed: {', '.join(allowed)})"


# Strict types: say why a value that looks like a number is refused, and how to write it.
_TYPE_HINTS = {
    "int_type": lambda v: isinstance(v, (bool, float, str)) or is_non_finite_json(v),
    "float_type": lambda v: isinstance(v, (bool, str)) or is_non_finite_json(v),
}


def _type_message(kind: str, value: Any) -> str:
    want = "an integer" if kind == "int_type" else "a number"
    if is_non_finite_json(value):
        return f"must be {want}, got {value!r}: JSON Infinity and NaN are not allowed"
    if isinstance(value, bool):
        return f"must be {want}, got the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"must be {want}, got the string {value[:40]!r} (write it without quotes)"
    if math.isfinite(value) and value == int(value):
        return f"must be an integer, got {value!r} (write {int(value)})"
    return f"must be an integer, got {value!r}"


def _with_input(msg: str, value: Any) -> str:
    # Show the offending value when it is short enough to read in one line.
    if isinstance(value, (dict, list, tuple)) or value is None:
        return msg
    shown = repr(value)
    return msg if len(shown) > 60 else f"{msg}, got {shown}"
