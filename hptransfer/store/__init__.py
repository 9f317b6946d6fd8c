"""The app database: schema, engine, migrations and the `Store` that reads and writes it."""

from .store import NotFoundError, Store

__all__ = ["NotFoundError", "Store"]
