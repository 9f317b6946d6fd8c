"""The outbox of MLflow records that could not be applied: JSON lines under one directory.

Layout: `<sweep>/sweep.jsonl` per sweep, `<sweep>/trial-<trial>.jsonl` per trial,
`_runs/run-<run>.jsonl` for runs started by another process, and `rejected.jsonl` for records
MLflow will never take. What goes in and how it is replayed is `tracking.Tracker`'s business;
this module only stores lines, in order, safely across threads and processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .params import safe_name

try:  # cross-process locking of the outbox; absent on Windows (threads are still locked)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


def now_ms() -> int:
    """Epoch milliseconds: records carry their own time, so a replay keeps it."""
    return int(time.time() * 1000)


class Outbox:
    """JSON-lines files under one directory, safe across threads and (POSIX) processes.

    Appends take a short exclusive lock on `.append.lock`; a replay holds `.replay.lock`
    (non-blocking: one replayer at a time) and rewrites a file only under the append lock,
    keeping whatever was appended meanwhile.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._thread_locks = {".append.lock": threading.Lock(), ".replay.lock": threading.Lock()}

    @contextlib.contextmanager
    def _locked(self, name: str, blocking: bool = True) -> Iterator[bool]:
        tlock = self._thread_locks[name]
        if not tlock.acquire(blocking):
            yield False
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                    except BlockingIOError:
                        yield False
                        return
                yield True
            finally:
                os.close(fd)  # closing releases the flock
        finally:
            tlock.release()

    def replaying(self) -> contextlib.AbstractContextManager[bool]:
        return self._locked(".replay.lock", blocking=False)

    def sweep_path(self, sweep_id: str | None) -> Path:
        return self.root / safe_name(sweep_id or "_nosweep") / "sweep.jsonl"

    def trial_path(self, sweep_id: str | None, trial_id: str) -> Path:
        folder = self.root / safe_name(sweep_id or "_nosweep")
        return folder / f"trial-{safe_name(trial_id)}.jsonl"

    def run_path(self, run_id: str) -> Path:
        return self.root / "_runs" / f"run-{safe_name(run_id)}.jsonl"

    def append(self, path: Path, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, default=str, allow_nan=True) + "\n"
        with self._locked(".append.lock"):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)

    def read(self, path: Path) -> list[str]:
        with self._locked(".append.lock"):
            try:
                return path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                return []

    def rewrite(self, path: Path, consumed: int, head: list[dict[str, Any]]) -> bool:
        """Drop the first `consumed` lines, prepend `head` if anything is left; True if gone."""
        with self._locked(".append.lock"):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                return True
            rest = lines[consumed:]
            if not rest:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # only when empty
                return True
            text = "".join(json.dumps(h, default=str) + "\n" for h in head)
            text += "".join(line + "\n" for line in rest)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
            return False

    def files(self) -> list[Path]:
        """Pending files, each sweep's own file before its trials' (trials need the sweep)."""
        if not self.root.is_dir():
            return []
        out: list[Path] = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            files = sorted(folder.glob("*.jsonl"), key=lambda p: (p.name != "sweep.jsonl", p.name))
            out.extend(files)
        return out

    def pending(self) -> int:
        return sum(len(self.read(p)) for p in self.files())

    def reject(self, record: Any, error: str) -> None:
        entry = {"ts": now_ms(), "error": error, "record": record}
        self.append(self.root / "rejected.jsonl", entry)
