"""Connecting to the app database and migrating it: URL handling, engine set-up (SQLite WAL,
busy timeout and explicit BEGIN; PostgreSQL via psycopg 3) and the Alembic migration runner.

On SQLite a write transaction must start with `BEGIN IMMEDIATE`, which takes the database's
single write lock before reading: pysqlite's own implicit BEGIN cannot do that, so the engine
runs the driver in autocommit and emits BEGIN itself. `for_writing(engine)` marks the
transactions that need IMMEDIATE.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, ExceptionContext, make_url
from sqlalchemy.pool import StaticPool

from hptransfer.config import sqlite_in_memory
from hptransfer.jsonsafe import json_safe

SQLITE_BUSY_TIMEOUT_MS = 30_000
_IMMEDIATE = "hpt_sqlite_immediate"  # execution option marking a write transaction

MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
# Alembic keeps the running migration's context in module globals: one command per process.
_MIGRATE_LOCK = threading.Lock()


def _json_dumps(obj: Any) -> str:
    # NaN/inf become None: PostgreSQL's json rejects them
    return json.dumps(json_safe(obj), allow_nan=False)


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; bare `postgresql://` / `postgres://` get the psycopg (v3) driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL, echo: bool = False,
                connect_timeout_s: int | None = None) -> Engine:
    """An engine configured for concurrent use (SQLite: WAL, busy timeout, explicit BEGIN);
    `connect_timeout_s` bounds a server database's connection (a host that drops packets
    otherwise holds it until the OS gives up, minutes later)."""
    url = normalize_url(url)
    if url.get_backend_name() != "sqlite":
        timeout = ({"connect_args": {"connect_timeout": connect_timeout_s}}
                   if connect_timeout_s and url.get_backend_name() == "postgresql" else {})
        return create_engine(url, echo=echo, pool_pre_ping=True, json_serializer=_json_dumps,
                             **timeout)

    memory = sqlite_in_memory(url)
    database = url.database or ""
    if not memory and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        echo=echo,
        json_serializer=_json_dumps,
        # the pool hands connections to whichever thread asks; each is used by one at a time
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        # an in-memory database lives in one connection (tests/toys; single-threaded only)
        **({"poolclass": StaticPool} if memory else {}),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Driver autocommit: pysqlite's own implicit BEGIN cannot do IMMEDIATE, so the
        # "begin" hook below emits BEGIN itself.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if not memory:
                # WAL: readers never block the writer and vice versa.
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "handle_error")
    def _drop_read_only_connection(context: ExceptionContext) -> None:
        # SQLite opens a connection read-only for good when the database's files cannot be
        # written at that moment (full disk, read-only remount); once they can, the pool
        # would still hand it out. Treated as a disconnect, it is discarded with the pool's
        # other connections (those may date from the outage too) and reopened on next use.
        if _is_read_only(context.original_exception):
            context.is_disconnect = True

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get(_IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _is_read_only(exc: BaseException) -> bool:
    """SQLite's "attempt to write a readonly database" (SQLITE_READONLY and its variants)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == sqlite3.SQLITE_READONLY
    return isinstance(exc, sqlite3.OperationalError) and "readonly database" in str(exc)


def for_writing(engine: Engine) -> Engine:
    """The same engine and pool, whose transactions begin IMMEDIATE on SQLite (no-op elsewhere)."""
    return engine.execution_options(**{_IMMEDIATE: True})


# --------------------------------------------------------------------------- migrations


def alembic_config() -> Any:
    """A programmatic Alembic config for the packaged migrations (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    # configparser interpolation: a literal '%' in the path must be doubled
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


def upgrade_to_head(engine: Engine) -> None:
    """Bring the schema to the newest revision (alembic upgrade head); safe to repeat."""
    from alembic import command

    cfg = alembic_config()
    # One transaction (IMMEDIATE on SQLite; env.py takes an advisory lock on PostgreSQL),
    # so two processes migrating at once run the revisions exactly once.
    with _MIGRATE_LOCK, for_writing(engine).begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def current_revision(engine: Engine) -> str | None:
    """The Alembic revision the database is at (None before the first migrate)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def probe_write(engine: Engine) -> None:
    """Write in a transaction that is rolled back: raises when the database answers but
    cannot be written (a read-only SQLite file or mount, a PostgreSQL standby or
    default_transaction_read_only). Touches the one row of Alembic's version table."""
    with for_writing(engine).connect() as conn, conn.begin() as tx:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")
        tx.rollback()


@functools.cache  # the packaged scripts do not change while the process runs (1-2 ms a parse)
def packaged_head() -> str | None:
    """The newest revision among the packaged migrations."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()
