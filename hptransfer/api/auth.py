"""Optional bearer token (HPT_API_TOKEN) for every mutating call."""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request


def require_token(request: Request) -> None:
    expected = request.app.state.coordinator.settings.api_token
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII str (a 500 before). Header values
    # arrive as latin-1, so this gives back the bytes the client sent.
    sent = token.encode("latin-1", "replace")
    if scheme.lower() != "bearer" or not secrets.compare_digest(sent, expected.encode()):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <HPT_API_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
