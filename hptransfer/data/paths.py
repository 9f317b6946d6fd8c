"""Where a shard source may point, and a bounded glob to expand it.

A sweep's `data.source` comes from whoever can reach the API, so the server resolves it
(symlinks and `..` resolved, `~` left literal: it is never the server user's home) and
accepts only paths inside its data roots. A path outside gets the same message whether or
not it exists, so errors reveal nothing about the server's files. Globs are matched by a walk
that stays under the pattern's fixed prefix, never follows directory symlinks, and stops at
a cap on entries, matches and time.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import DataError

GLOB_CHARS = "*?["
MAX_GLOB_MATCHES = 10_000
MAX_GLOB_ENTRIES = 200_000  # directory entries looked at by one glob
GLOB_TIME_LIMIT_S = 5.0


def has_glob(source: str) -> bool:
    return any(ch in source for ch in GLOB_CHARS)


def outside_roots_error(source: str, roots: Sequence[Path]) -> DataError:
    # One message for every refused path: nothing about whether it exists or what it is.
    shown = ", ".join(str(r) for r in roots)
    return DataError(
        f"data source {source!r} is not inside the server's data roots ({shown}); use "
        "'stdlib' for the embedded corpus, or put the shards under a data root "
        "(HPT_DATA_ROOTS adds more)"
    )


def inside(path: Path, roots: Sequence[Path]) -> bool:
    """Whether `path` (symlinks and `..` resolved) lies in one of `roots` (resolved)."""
    real = Path(os.path.realpath(path))
    return any(real == root or real.is_relative_to(root) for root in roots)


def check_inside(source: str, paths: Sequence[Path], roots: Sequence[Path] | None) -> None:
    if roots is not None and not all(inside(p, roots) for p in paths):
        raise outside_roots_error(source, roots)


def absolute(source: str) -> Path:
    """`source` as an absolute path, `~` taken literally (relative to the working directory)."""
    return Path(os.path.abspath(source))


def bounded_glob(pattern: str, roots: Sequence[Path] | None) -> list[Path]:
    """The files `pattern` matches (``*``/``?``/``[]`` within a name, ``**`` across
    directories; names starting with '.' only when the pattern's part does), sorted.

    The walk starts at the pattern's fixed prefix, which must be inside a root; it does not
    follow directory symlinks, and every match must resolve inside a root too."""
    parts = absolute(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if has_glob(part))
    base, rest = Path(*parts[:fixed]), list(parts[fixed:])
    check_inside(pattern, [base], roots)
    deadline = time.monotonic() + GLOB_TIME_LIMIT_S
    entries = 0
    matches: list[Path] = []
    recursive = "**" in rest
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        rel = Path(dirpath).relative_to(base).parts
        if not recursive and len(rel) >= len(rest) - 1:
            dirnames[:] = []  # deep enough: the remaining part names the file
        entries += len(dirnames) + len(filenames)
        if entries > MAX_GLOB_ENTRIES or time.monotonic() > deadline:
            raise DataError(
                f"glob {pattern!r} looks at too many files (limit {MAX_GLOB_ENTRIES} entries "
                f"or {GLOB_TIME_LIMIT_S:g} s); narrow the pattern"
            )
        for name in filenames:
            if _match([*rel, name], rest):
                matches.append(Path(dirpath) / name)
                if len(matches) > MAX_GLOB_MATCHES:
                    raise DataError(
                        f"glob {pattern!r} matches more than {MAX_GLOB_MATCHES} files; "
                        "narrow the pattern"
                    )
    check_inside(pattern, matches, roots)
    return sorted(matches)


def _match(names: Sequence[str], pattern: Sequence[str]) -> bool:
    """Whether path components `names` match pattern components (``**`` = any number)."""
    if not pattern:
        return not names
    head, tail = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(names[i:], tail) for i in range(len(names) + 1)
                   if not any(n.startswith(".") for n in names[:i]))
    if not names:
        return False
    name = names[0]
    if name.startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, head) and _match(names[1:], tail)
