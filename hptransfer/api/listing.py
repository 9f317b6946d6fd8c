"""Rendered listing bodies (a JSON page of /sweeps, the /dashboards index) kept until the
coordinator's listing version moves (a commit to the app database, a change in why sweeps
wait), and at most `LISTING_TTL_S` seconds (writers in other processes move no counter).

Many clients polling the listings then cost one set of queries and one rendering per
change instead of one per request; a hit is a dictionary look-up on the event loop, and a
miss is built once in a worker thread while the other requests for that key wait for it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

LISTING_TTL_S = 1.0
MAX_ENTRIES = 64  # distinct (route, limit, offset) keys kept


@dataclass(frozen=True)
class _Entry:
    version: Any
    built_at: float
    body: bytes


class ListingCache:
    def __init__(self, version: Callable[[], Any], ttl_s: float = LISTING_TTL_S) -> None:
        self._version = version
        self._ttl_s = ttl_s
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._locks: dict[Hashable, threading.Lock] = {}
        self._guard = threading.Lock()

    def _fresh(self, key: Hashable) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry.built_at > self._ttl_s:
            return None
        return entry.body if entry.version == self._version() else None

    def _build(self, key: Hashable, build: Callable[[], bytes]) -> bytes:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # one build per key at a time; the requests queued behind it reuse it
            body = self._fresh(key)
            if body is not None:
                return body
            # noted before the queries: a commit during the build makes the entry stale
            version, built_at = self._version(), time.monotonic()
            body = build()
            with self._guard:
                self._entries[key] = _Entry(version, built_at, body)
                self._entries.move_to_end(key)
                while len(self._entries) > MAX_ENTRIES:
                    old, _ = self._entries.popitem(last=False)
                    self._locks.pop(old, None)
            return body

    async def get(self, key: Hashable, build: Callable[[], bytes]) -> bytes:
        """The body for `key`: cached while still current, else built in a worker thread."""
        body = self._fresh(key)
        if body is not None:
            return body
        return await run_in_threadpool(self._build, key, build)
