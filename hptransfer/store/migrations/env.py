"""Alembic environment for the hptransfer app database.

At runtime `Store.migrate()` passes its own connection in `config.attributes["connection"]`
(no alembic.ini). To write a new revision, autogenerate it against a database at head:

    from alembic import command
    from hptransfer.store.engine import alembic_config
    cfg = alembic_config()
    cfg.set_main_option("sqlalchemy.url", "sqlite:///scratch.db")  # else HPT_DATABASE_URL
    command.upgrade(cfg, "head")
    command.revision(cfg, message="add x", autogenerate=True)
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from hptransfer.config import get_settings
from hptransfer.store.engine import make_engine, normalize_url
from hptransfer.store.schema import Base

config = context.config
target_metadata = Base.metadata

# Any constant shared by every hptransfer process: serialises concurrent migrations on PG.
_PG_MIGRATION_LOCK = 0x68707400


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or get_settings().database_url
    return normalize_url(url).render_as_string(hide_password=False)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Held to the end of the transaction: a second process waits, then finds head.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
        context.run_migrations()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
