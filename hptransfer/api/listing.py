"""Rendered listing bodies (a JSON page of /sweeps, the /dashboards index) kept until the
coordinator's listing version moves (a commit to the app database, a change in why sweeps
wait), and at most `LISTING_TTL_S` seconds (writers in other processes move no counter).

Many clients polling the listings then cost one set of queries and one rendering per
change instead of one per request; a hit is a dictionary look-up on the event loop, and a
miss is built once in a worker thread while the other requests for that key wait for it.

Each body carries an ETag (a hash of its bytes, computed once per build): a client that
polls with If-None-Match gets a bodiless 304 while the listing has not changed.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

LISTING_TTL_S = 1.0
MAX_ENTRIES = 64  # distinct (route, limit, offset) keys kept


@dataclass(frozen=True)
class _Entry:
    version: Any
    built_at: float
    body: bytes
    etag: str  # a strong validator: the same bytes, the same tag, across rebuilds


def etag_of(body: bytes) -> str:
    return '"' + hashlib.blake2b(body, digest_size=16).hexdigest() + '"'


def _matches(if_none_match: str, etag: str) -> bool:
    """RFC 9110 If-None-Match: a list of tags (weak comparison) or "*"."""
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return etag in tags or "*" in tags


class ListingCache:
    def __init__(self, version: Callable[[], Any], ttl_s: float = LISTING_TTL_S) -> None:
        self._version = version
        self._ttl_s = ttl_s
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._locks: dict[Hashable, threading.Lock] = {}
        self._guard = threading.Lock()

    def _fresh(self, key: Hashable) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry.built_at > self._ttl_s:
            return None
        return entry if entry.version == self._version() else None

    def _build(self, key: Hashable, build: Callable[[], bytes]) -> _Entry:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # one build per key at a time; the requests queued behind it reuse it
            entry = self._fresh(key)
            if entry is not None:
                return entry
            # noted before the queries: a commit during the build makes the entry stale
            version, built_at = self._version(), time.monotonic()
            body = build()
            entry = _Entry(version, built_at, body, etag_of(body))
            with self._guard:
                self._entries[key] = entry
                self._entries.move_to_end(key)
                while len(self._entries) > MAX_ENTRIES:
                    old, _ = self._entries.popitem(last=False)
                    self._locks.pop(old, None)
            return entry

    async def _entry(self, key: Hashable, build: Callable[[], bytes]) -> _Entry:
        entry = self._fresh(key)
        if entry is not None:
            return entry
        return await run_in_threadpool(self._build, key, build)

    async def get(self, key: Hashable, build: Callable[[], bytes]) -> bytes:
        """The body for `key`: cached while still current, else built in a worker thread."""
        return (await self._entry(key, build)).body

    async def respond(self, request: Request, key: Hashable, build: Callable[[], bytes],
                      media_type: str) -> Response:
        """The listing as a response with its ETag; 304 without a body when the client's
        If-None-Match already names it. `no-cache`: a browser revalidates on every load,
        so it never shows a listing older than the server's."""
        entry = await self._entry(key, build)
        headers = {"ETag": entry.etag, "Cache-Control": "no-cache"}
        if _matches(request.headers.get("if-none-match", ""), entry.etag):
            return Response(status_code=304, headers=headers)
        return Response(entry.body, media_type=media_type, headers=headers)
