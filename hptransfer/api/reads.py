"""Who may read: with HPT_API_TOKEN set, every read (listings, trials, fits, dashboards)
needs the bearer token too, unless HPT_PUBLIC_READS=1 opens them (a public dashboard).

An open read costs what its defaults cost: a fit report at any bootstrap but the default is
another entry in the fit cache and seconds of CPU each (2000: ~26 s), so a client without
the token gets the default only. /health answers everyone, with its details for the
token's holders only (`hptransfer.api.health`).
"""

from __future__ import annotations

from fastapi import HTTPException, Request

from .auth import require_token

# the fit report's default bootstrap: the one an anonymous client may ask for
ANONYMOUS_BOOTSTRAP = 100


def trusted(request: Request) -> bool:
    """Whether the request may see and ask for everything: no token is configured, or it
    sent the right one. A wrong token is a 401, never a quiet downgrade to anonymous."""
    if not request.app.state.coordinator.settings.api_token:
        return True
    if "authorization" not in request.headers:
        return False
    require_token(request)
    return True


def require_reader(request: Request) -> None:
    """The dependency of every read route: the token, unless reads are public."""
    settings = request.app.state.coordinator.settings
    if settings.public_reads and "authorization" not in request.headers:
        return
    require_token(request)


def check_bootstrap(request: Request, bootstrap: int) -> None:
    """401 for an anonymous fit report at a bootstrap other than the default."""
    if bootstrap != ANONYMOUS_BOOTSTRAP and not trusted(request):
        raise HTTPException(
            status_code=401,
            detail=(f"bootstrap={bootstrap} needs the bearer token: without it fit reports "
                    f"come at the default bootstrap={ANONYMOUS_BOOTSTRAP} only (leave the "
                    "parameter out, or send 'Authorization: Bearer <HPT_API_TOKEN>')"),
            headers={"WWW-Authenticate": "Bearer"},
        )
