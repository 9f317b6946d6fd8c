"""Credentials out of what the service shows: URLs with their password and secret-looking
query values masked, and free text (an error message that quotes a URL) scrubbed the same
way. Every URL or error text that reaches a response, `hpt doctor` or a log goes through
here."""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

SECRET_KEYS = ("password", "passwd", "pwd", "token", "secret", "key", "auth")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
# credentials as database drivers read them, not as urlsplit does: a user name (no ':' or
# '/'), then ':' and a password that may hold a raw '/', '#' or '?' (SQLAlchemy takes
# postgresql://u:ml/pw@host/db), up to the last '@'; or a bare token@. Where an '@' comes
# later in a URL without credentials (http://h:80/p?mail=a@b), more is masked than needed.
_USERINFO = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@?#]*)(?::(?P<password>.*))?@")
# key=value outside a URL (a libpq DSN "host=h password=pw", a quoted query string); the key
# ends with the secret word, so "access_token=" is masked and "max_tokens=" is not
_SECRET_ASSIGNMENT = re.compile(
    r"\b([\w.-]*(?:password|passwd|pwd|token|secret))=(?!\*\*\*)[^\s&'\",;]+",
    re.IGNORECASE)


# The passwords of the URLs this process was configured with (`remember_url_secrets`, from
# config.get_settings): a driver's error can quote a piece of one as something else, e.g. the
# host 'Secret2@127.0.0.1' when a raw '@' split postgresql://u:pw@Secret2@127.0.0.1/db, or the
# port 'Secret1' of http://u:Secret1/x@h. Each is masked wherever it appears in text `redact`
# sees; pieces shorter than this are not (a short piece would mask ordinary words).
_KNOWN_SECRETS: set[str] = set()
MIN_SECRET_PIECE = 4


def remember_url_secrets(*urls: str | None) -> None:
    """Mask these URLs' passwords, and each piece of them between '@', '/', '?', '#' or
    ':', in `redact`."""
    for url in urls:
        m = _USERINFO.match(url or "")
        if m is None or m["password"] is None:
            continue
        for password in {m["password"], unquote(m["password"])}:
            pieces = (password, *re.split(r"[@/?#:]", password))  # where a parser cuts it
            _KNOWN_SECRETS.update(p for p in pieces if len(p) >= MIN_SECRET_PIECE)


def _secret(key: str) -> bool:
    return any(s in key.lower() for s in SECRET_KEYS)


def mask_url(url: str | None) -> str | None:
    """The URL with any password (user:pw@) or bare credential (token@) and secret-looking
    query values replaced by ***."""
    if not url:
        return url
    out = _USERINFO.sub(_masked_userinfo, url, count=1)
    try:
        query = urlsplit(out).query
    except ValueError:  # malformed (http://[::1): credentials are masked above, a query here
        return out.split("?", 1)[0] + ("?***" if "?" in out else "")
    if query:  # edited in place: urlunsplit would rewrite sqlite://// as sqlite://
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret(k) for k, _ in pairs):
            masked = urlencode([(k, "***" if _secret(k) else v) for k, v in pairs], safe="*")
            out = out.replace("?" + query, "?" + masked, 1)
    return out


def _masked_userinfo(m: re.Match[str]) -> str:
    return f"{m['scheme']}{m['user']}:***@" if m["password"] is not None else \
        f"{m['scheme']}***@"


def redact(text: str | None) -> str | None:
    """`text` with every URL in it masked (`mask_url`) and any password=..., token=...
    outside a URL replaced by ***."""
    if not text:
        return text
    text = _URL.sub(lambda m: mask_url(m.group(0)) or "", text)
    text = _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group(1)}=***", text)
    for secret in sorted(_KNOWN_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


class RedactingFilter(logging.Filter):
    """A log handler's filter that passes each record's message and traceback through
    `redact`: a database error logged at start-up quotes its URL, or a piece of its
    password as a host name."""

    def filter(self, record: logging.LogRecord) -> bool:
        # msg and args are redacted apart, not joined: a formatter may read the args
        # (uvicorn's access formatter unpacks them into client, method, path, status)
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted_arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redacted_arg(v) for k, v in record.args.items()}
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def first_line(text: str | None) -> str:
    """An error text's first line (without the traceback or the SQL that follows it),
    credentials masked: what a response or a stored error may show of it."""
    lines = (text or "").strip().splitlines()
    return (redact(lines[0]) or "") if lines else ""


def _redacted_arg(arg: object) -> object:
    """The argument itself unless its text holds a secret (an int stays an int for %d)."""
    text = str(arg)
    shown = redact(text)
    return arg if shown == text else shown


def redact_logs(*logger_names: str) -> None:
    """Put a RedactingFilter on every handler of these loggers (and the root logger's)."""
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
