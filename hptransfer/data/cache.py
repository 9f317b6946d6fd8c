"""Atomic cache writes: several Ray workers may build the same cache entry at once."""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import DataError


def ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"cannot create cache directory {path}: {exc}; pass cache_dir= or set HPT_HOME "
            "to a writable place"
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
