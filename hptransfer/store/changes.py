"""A counter of the write transactions committed through one engine: a cheap "has anything
changed?" for caches of query results (the listings), read without a query.

It moves twice per commit: when the commit starts, and again when the connection that
committed goes back to the pool, i.e. once the commit is visible to every reader. A reader
that noted the value before querying can then never keep rows from before a commit under a
value from after it. Writers in other processes are not seen: callers bound staleness with
a time limit of their own.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

_COMMITTED = "hpt_committed"  # marks a pooled connection that committed since its checkout


class CommitCounter:
    def __init__(self, engine: Engine) -> None:
        self._value = 0
        self._lock = threading.Lock()
        event.listen(engine, "commit", self._on_commit)
        event.listen(engine, "checkin", self._on_checkin)

    @property
    def value(self) -> int:
        return self._value

    def _bump(self) -> None:
        with self._lock:
            self._value += 1

    def _on_commit(self, conn: Connection) -> None:
        conn.info[_COMMITTED] = True
        self._bump()

    def _on_checkin(self, _dbapi_conn: Any, record: Any) -> None:
        if record is not None and record.info.pop(_COMMITTED, False):
            self._bump()
