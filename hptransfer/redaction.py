"""Credentials out of what the service shows: URLs with their password and secret-looking
query values masked, and free text (an error message that quotes a URL) scrubbed the same
way. Every URL or error text that reaches a response, `hpt doctor` or a log goes through
here."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

SECRET_KEYS = ("password", "passwd", "pwd", "token", "secret", "key", "auth")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
# key=value outside a URL (a libpq DSN "host=h password=pw", a quoted query string); the key
# ends with the secret word, so "access_token=" is masked and "max_tokens=" is not
_SECRET_ASSIGNMENT = re.compile(
    r"\b([\w.-]*(?:password|passwd|pwd|token|secret))=(?!\*\*\*)[^\s&'\",;]+",
    re.IGNORECASE)


def _secret(key: str) -> bool:
    return any(s in key.lower() for s in SECRET_KEYS)


def mask_url(url: str | None) -> str | None:
    """The URL with any password (user:pw@) and secret-looking query values replaced by ***."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    out = url  # edited in place: urlunsplit would rewrite sqlite://// as sqlite://
    if "@" in parts.netloc:
        creds, host = parts.netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        out = out.replace(parts.netloc, f"{user}:***@{host}" if ":" in creds else f"***@{host}",
                          1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(_secret(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _secret(k) else v) for k, v in pairs], safe="*")
            out = out.replace("?" + parts.query, "?" + query, 1)
    return out


def redact(text: str | None) -> str | None:
    """`text` with every URL in it masked (`mask_url`) and any password=..., token=...
    outside a URL replaced by ***."""
    if not text:
        return text
    text = _URL.sub(lambda m: mask_url(m.group(0)) or "", text)
    return _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group(1)}=***", text)
