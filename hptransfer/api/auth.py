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
    if scheme.lower() != "bearer" or not secrets.compare_digest(token, expected):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <HPT_API_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
