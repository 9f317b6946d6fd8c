"""Where a shard source may point, and a bounded glob to expand it.

A sweep's `data.source` comes from whoever can reach the API, so the server resolves it
(symlinks and `..` resolved, `~` left literal: it is never the server user's home) and
accepts only paths inside its data roots. A path outside gets the same message whether or
not it exists, so errors reveal nothing about the server's files. Globs are matched by a walk
that stays under the pattern's fixed prefix, never follows directory symlinks, descends only
into directories the rest of the pattern can still match below, and stops at a cap on
entries, matches and time; listing a directory stops at the same caps.

The matcher keeps, for each directory, the set of pattern positions its path can have reached
(consecutive ``**`` collapsed into one): one step per name, so a file costs at most
(pattern length) name comparisons however many ``**`` the pattern repeats.
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
MAX_GLOB_ENTRIES = 200_000  # directory entries looked at by one glob (or directory listing)
GLOB_TIME_LIMIT_S = 5.0


def has_glob(source: str) -> bool:
    return any(ch in source for ch in GLOB_CHARS)


def control_character(source: str) -> str | None:
    """The first control character (NUL, newline, DEL, ...) in `source`, or None."""
    return next((ch for ch in source if ord(ch) < 32 or 127 <= ord(ch) < 160), None)


def outside_roots_error(source: str, roots: Sequence[Path]) -> DataError:
    # One message for every refused path: nothing about whether it exists or what it is.
    shown = ", ".join(str(r) for r in roots)
    return DataError(
        f"data source {source!r} is not inside the server's data roots ({shown}); use "
        "'stdlib' for the embedded corpus, or put the shards under a data root "
        "(HPT_DATA_ROOTS adds more)"
    )


def inside(path: Path, roots: Sequence[Path]) -> bool:
    """Whether `path` (symlinks and `..` resolved) lies in one of `roots` (resolved); a path
    that cannot be resolved (an embedded NUL) lies in none."""
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return False
    return any(real == root or real.is_relative_to(root) for root in roots)


def check_inside(source: str, paths: Sequence[Path], roots: Sequence[Path] | None) -> None:
    if roots is None:
        return
    for path in paths:
        if inside(path, roots):
            continue
        if any(absolute(str(path)).is_relative_to(root) for root in roots):
            # under a root as written, outside once resolved: a link leading out. Named (it
            # is under the roots, where the caller's shards are), not where it leads.
            raise DataError(
                f"data source {source!r}: {str(path)!r} is a symbolic link (or a path "
                "through one) that leads outside the server's data roots; replace it with "
                "the file itself or remove it")
        raise outside_roots_error(source, roots)


def absolute(source: str) -> Path:
    """`source` as an absolute path, `~` taken literally (relative to the working directory)."""
    return Path(os.path.abspath(source))


def _too_much(what: str, fix: str = "narrow the pattern") -> DataError:
    return DataError(
        f"{what} looks at too many files (limit {MAX_GLOB_ENTRIES} entries or "
        f"{GLOB_TIME_LIMIT_S:g} s); {fix}"
    )


def _too_many(what: str, files: str = "files", fix: str = "narrow the pattern") -> DataError:
    return DataError(f"{what} more than {MAX_GLOB_MATCHES} {files}; {fix}")


def bounded_glob(pattern: str, roots: Sequence[Path] | None) -> list[Path]:
    """The files `pattern` matches (``*``/``?``/``[]`` within a name, ``**`` across
    directories; names starting with '.' only when the pattern's part does), sorted.

    The walk starts at the pattern's fixed prefix, which must be inside a root; it does not
    follow directory symlinks, and every match must resolve inside a root too. A pattern
    whose wildcards all went with a `..` (``d/*/..``) names its fixed path."""
    what = f"glob {pattern!r}"
    parts = absolute(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if has_glob(part)), len(parts))
    base, rest = Path(*parts[:fixed]), _collapse(parts[fixed:])
    check_inside(pattern, [base], roots)
    if not rest:
        return [base] if base.is_file() else []
    matcher = _Matcher(rest, time.monotonic() + GLOB_TIME_LIMIT_S, what)
    states = {os.fspath(base): matcher.start}
    entries = 0
    matches: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        here = states.pop(dirpath)
        entries += len(dirnames) + len(filenames)
        if entries > MAX_GLOB_ENTRIES:
            raise _too_much(what)
        matcher.check_time()
        kept = []
        for name in dirnames:  # descend only where the rest of the pattern can still match
            below = matcher.step(here, name)
            if matcher.can_continue(below):
                kept.append(name)
                states[os.path.join(dirpath, name)] = below
        dirnames[:] = kept
        for name in filenames:
            if matcher.accepts(matcher.step(here, name)):
                matches.append(Path(dirpath) / name)
                if len(matches) > MAX_GLOB_MATCHES:
                    raise _too_many(f"{what} matches")
    matches.sort()  # the first link leading out, named, is the same one every time
    check_inside(pattern, matches, roots)
    # os.walk lists every non-directory: keep the files (a FIFO or a dangling link is none)
    return [p for p in matches if p.is_file()]


def bounded_listing(directory: Path, source: str, suffix: str = ".bin") -> list[Path]:
    """The files named ``*<suffix>`` directly in `directory`, sorted, under the glob's caps
    (entries looked at, files returned, time)."""
    what = f"data source {source!r}"
    fix = "point at a subdirectory or a glob that names fewer shards"
    deadline = time.monotonic() + GLOB_TIME_LIMIT_S
    files: list[Path] = []
    with os.scandir(directory) as it:
        for entries, entry in enumerate(it, start=1):
            if entries > MAX_GLOB_ENTRIES or time.monotonic() > deadline:
                raise _too_much(what, fix)
            if Path(entry.name).suffix == suffix and entry.is_file():
                files.append(Path(entry.path))
                if len(files) > MAX_GLOB_MATCHES:
                    raise _too_many(f"{what} holds", f"{suffix} files", fix)
    return sorted(files)


def _collapse(parts: Sequence[str]) -> tuple[str, ...]:
    """Pattern components with each run of ``**`` as one (a run matches what one matches)."""
    out: list[str] = []
    for part in parts:
        if not (part == "**" and out and out[-1] == "**"):
            out.append(part)
    return tuple(out)


class _Matcher:
    """Matches path components against pattern components (``**`` = any number of names not
    starting with '.') by tracking the set of pattern positions reachable so far: the memo of
    the backtracking match, one set per directory, so no position is tried twice per name."""

    def __init__(self, pattern: Sequence[str], deadline: float, what: str) -> None:
        self.pattern = tuple(pattern)
        self.deadline = deadline
        self.what = what
        self.start = self._closure({0})

    def _closure(self, states: set[int]) -> frozenset[int]:
        # ``**`` may match no name: a position before one reaches the position after it too
        # (runs are collapsed, so one step suffices).
        pattern = self.pattern
        return frozenset(states | {j + 1 for j in states
                                   if j < len(pattern) and pattern[j] == "**"})

    def step(self, states: frozenset[int], name: str) -> frozenset[int]:
        """The positions reachable from `states` after one more path component `name`."""
        self.check_time()
        hidden = name.startswith(".")
        pattern, reached = self.pattern, set()
        for j in states:
            if j == len(pattern):
                continue
            part = pattern[j]
            if part == "**":
                if not hidden:
                    reached.add(j)
            elif (not hidden or part.startswith(".")) and fnmatch.fnmatchcase(name, part):
                reached.add(j + 1)
        return self._closure(reached)

    def accepts(self, states: frozenset[int]) -> bool:
        return len(self.pattern) in states

    def can_continue(self, states: frozenset[int]) -> bool:
        """Whether a name below a directory at `states` could still match."""
        return any(j < len(self.pattern) for j in states)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _too_much(self.what)
