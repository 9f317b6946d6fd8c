"""Optional bearer token (HPT_API_TOKEN) for every mutating call, and a brake on guessing it."""

from __future__ import annotations

import math
import secrets
import time
from collections import deque

from fastapi import HTTPException, Request

# seconds over which a client address's failed attempts are counted
FAILURE_WINDOW_S = 60.0
# addresses remembered at most (the oldest are forgotten first): the brake's memory is bounded
MAX_ADDRESSES = 10_000


class AuthThrottle:
    """At most `limit` missing or wrong tokens per client address in any FAILURE_WINDOW_S;
    past that, every call of that address that needs the token is answered 429 until the
    oldest failure leaves the window, the right token included (else a guesser would learn
    which guess was right). Clients behind one proxy address share the allowance."""

    def __init__(self, limit: int, window_s: float = FAILURE_WINDOW_S) -> None:
        self.limit, self.window_s = limit, window_s
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, address: str, now: float) -> deque[float]:
        times = self._failures.get(address, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return times

    def wait_s(self, address: str, now: float | None = None) -> int:
        """Seconds until `address` may try again; 0 when it may now."""
        now = time.monotonic() if now is None else now
        times = self._recent(address, now)
        if len(times) < self.limit:
            return 0
        return max(1, math.ceil(times[0] + self.window_s - now))

    def failed(self, address: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        times = self._recent(address, now)
        times.append(now)
        self._failures.pop(address, None)  # re-inserted last: the dict stays oldest-first
        self._failures[address] = times
        while len(self._failures) > MAX_ADDRESSES:
            del self._failures[next(iter(self._failures))]


def require_token(request: Request) -> None:
    expected = request.app.state.coordinator.settings.api_token
    if not expected:
        return
    throttle: AuthThrottle = request.app.state.auth_throttle
    address = request.client.host if request.client else "unknown"
    if wait := throttle.wait_s(address):
        raise HTTPException(
            status_code=429,
            detail=f"too many calls with a missing or wrong bearer token from {address}: "
                   f"retry in {wait} s with the right token (HPT_API_TOKEN)",
            headers={"Retry-After": str(wait)},
        )
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII str (a 500 before). Header values
    # arrive as latin-1, so this gives back the bytes the client sent.
    sent = token.encode("latin-1", "replace")
    if scheme.lower() != "bearer" or not secrets.compare_digest(sent, expected.encode()):
        throttle.failed(address)
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <HPT_API_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
