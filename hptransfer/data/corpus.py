"""The embedded default corpus: Python standard library source, present on every machine."""

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .errors import DataError

# Vendored packages and test suites are excluded: they differ between installs and are noisy.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
FILE_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    """Whole files in order; the corpus text is `FILE_SEPARATOR.join(pieces)`."""

    pieces: tuple[bytes, ...]
    files: tuple[str, ...]

    @cached_property
    def data(self) -> bytes:
        return FILE_SEPARATOR.join(self.pieces)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative posix paths of the stdlib `.py` files, sorted (the corpus order)."""
    root = stdlib_root() if root is None else root
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into excluded trees (site-packages is big).
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(found)


def load_stdlib_corpus(max_bytes: int | None, root: Path | None = None) -> Corpus:
    """Whole files in sorted order, skipping any file that would push the corpus past
    `max_bytes` (so the cap is filled even when a large file comes early)."""
    root = stdlib_root() if root is None else root
    files = stdlib_files(root)
    if not files:
        raise DataError(f"no .py files found under the standard library directory {root}")
    pieces: list[bytes] = []
    taken: list[str] = []
    total = 0
    for rel in files:
        path = root / rel
        separator = len(FILE_SEPARATOR) if pieces else 0
        # stat first so oversized files are never read; the length check below is what counts.
        if max_bytes is not None and total + separator + path.stat().st_size > max_bytes:
            continue
        content = path.read_bytes()
        if max_bytes is not None and total + separator + len(content) > max_bytes:
            continue
        pieces.append(content)
        taken.append(rel)
        total += separator + len(content)
    if total == 0:  # empty files (package __init__.py) fit any bound and add nothing
        raise DataError(f"max_corpus_bytes={max_bytes} is smaller than every stdlib file; raise it")
    return Corpus(pieces=tuple(pieces), files=tuple(taken))
