"""What every part of the `Store` shares: its engine and sessions, its errors, and the sweep
row lock that orders concurrent writers.

The operation modules (sweeps, studies, trials, leasing, outcomes, mirror_queue) each define a
mixin on `StoreBase`; store.py composes them into `Store`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from hptransfer.redaction import mask_url

from .engine import for_writing, make_engine, normalize_url
from .schema import Sweep


class StoreError(Exception):
    """A request the store cannot satisfy (bad status, adding to a finished sweep, ...)."""


class NotFoundError(StoreError, LookupError):
    """No sweep or trial with that id."""


class StoreBase:
    """The database connection: one engine, a session for reading and one for writing."""

    def __init__(self, url: str | URL, *, echo: bool = False) -> None:
        self.url = normalize_url(url)
        self.engine = make_engine(self.url, echo=echo)
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        # Same pool; on SQLite its transactions begin IMMEDIATE (see store.py's docstring).
        self._writer = sessionmaker(for_writing(self.engine), expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    @property
    def url_safe(self) -> str:
        """The database URL with the password masked (for logs and /health), in user:pw@
        and in the query string (libpq takes ?password=)."""
        return mask_url(self.url.render_as_string(hide_password=False)) or ""

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def _read(self) -> Session:
        return self._reader()

    def _write(self) -> AbstractContextManager[Session]:
        return self._writer.begin()


def locked_sweep(s: Session, sweep_id: str) -> Sweep:
    """The sweep row, locked for this transaction (FOR NO KEY UPDATE on PostgreSQL; SQLite's
    IMMEDIATE transaction already holds the write lock); NotFoundError if there is none."""
    sweep = s.get(Sweep, sweep_id, with_for_update={"key_share": True})
    if sweep is None:
        raise NotFoundError(f"no sweep {sweep_id!r:.80}")
    return sweep
