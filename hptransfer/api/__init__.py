"""FastAPI app: routers, schemas and auth; no logic the CLI or client would also need."""

from .app import create_app

__all__ = ["create_app"]
