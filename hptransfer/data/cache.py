"""The data cache's files: atomic writes (several Ray workers may build the same entry at
once), and a size cap. Entries are content-addressed and rebuilt the same when missing, so
the least recently used go once the cache holds more than `config.cache_max_bytes()`: each
distinct corpus size or BPE vocabulary a request names writes a new one (up to ~22 MB)."""

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hptransfer.config import cache_max_bytes, dir_problem

from .errors import DataError

log = logging.getLogger(__name__)
# an entry used this recently may be in use right now (a sweep starting its trials): kept
MIN_IDLE_S = 600.0
# a temp file (".name.*.tmp") this old is a killed writer's leftover, not a write in progress
STALE_TMP_S = 3600.0


def ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # the diagnosis `hpt serve` gives of the same folder
        raise DataError(
            f"cannot create cache directory {path}: {dir_problem(path) or exc}; pass "
            "cache_dir= or set HPT_HOME to a writable place"
        ) from exc
    return path


def write_atomic(final: Path, write: Callable[[Path], None], *, first_wins: bool = False) -> None:
    """Call `write(tmp)` on a temp file next to `final`, then publish it in one step.

    Readers never see a partial file. With `first_wins`, an entry that already exists is kept
    (hard link fails if present) so that concurrent builders all end up using the same file even
    if their outputs differ; otherwise the last writer replaces it (for content-addressed files).
    """
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        if first_wins:
            try:
                os.link(tmp, final)
            except FileExistsError:
                pass
            except OSError:
                # Filesystems without hard links: fall back to replace (last writer wins).
                os.replace(tmp, final)
        else:
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def publish(final: Path, write: Callable[[Path], None], *, first_wins: bool = False) -> bool:
    """`write_atomic`, except that a cache that cannot be written (read-only, full, another
    user's) is no error: the caller serves what it built from memory. False then."""
    try:
        write_atomic(final, write, first_wins=first_wins)
    except OSError as exc:
        log.warning("data cache %s not written (%s); serving it from memory, rebuilt on "
                    "the next load", final, exc)
        return False
    return True


def mark_used(path: Path) -> None:
    """A cache hit: the entry's modification time is its last use (what eviction orders by)."""
    with contextlib.suppress(OSError):  # a read-only cache still serves its entries
        os.utime(path)


def evict_least_used(directory: Path, keep: Path, max_bytes: float | None = None,
                     min_idle_s: float = MIN_IDLE_S) -> int:
    """Delete the least recently used entries of `directory` until it holds at most
    `max_bytes` (default: the configured cap), never `keep` nor an entry used in the last
    `min_idle_s` seconds; the number deleted."""
    cap = cache_max_bytes() if max_bytes is None else max_bytes
    entries = []
    now, removed = time.time(), 0
    with contextlib.suppress(OSError), os.scandir(directory) as it:
        for entry in it:
            if not entry.is_file(follow_symlinks=False):
                continue  # not ours
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if not entry.name.startswith("."):
                    entries.append((st.st_mtime, st.st_size, Path(entry.path)))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    # a writer killed mid-write (its `finally` never ran): never published,
                    # never read, and it would hold its space for good
                    os.unlink(entry.path)
                    removed += 1
    total = sum(size for _, size, _ in entries)
    for used, size, path in sorted(entries):
        if total <= cap:
            break
        if path == keep or now - used < min_idle_s:
            continue
        with contextlib.suppress(FileNotFoundError):  # another process evicted it first
            path.unlink()
        total -= size
        removed += 1
    if removed:
        log.info("data cache %s: removed %d least recently used entries (cap %.3g GB)",
                 directory, removed, cap / 1e9)
    return removed
