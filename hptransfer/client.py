"""Python client for the hptransfer REST API."""

from __future__ import annotations

import re
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import yaml

from hptransfer.config import client_token, client_url, token_problem
from hptransfer.contracts.status import ACTIVE, SweepStatus
from hptransfer.redaction import mask_url, redact
from hptransfer.spec.text import (
    MAX_NESTING,
    NESTED_TOO_DEEPLY,
    load_yaml,
    looks_like_path,
    nesting_depth,
    non_finite_paths,
)

DEFAULT_URL = "http://127.0.0.1:8600"
SUBMIT_RETRIES = 2  # a submit is sent again after no answer (its Idempotency-Key dedups)
# A GET is sent once more when its connection drops: the pooled keep-alive connection may be
# one the server closed (uvicorn does after 5 s idle) just as it was reused. Not after a
# timeout: the server had the request, and another wait would double the one promised.
GET_RESENDS = 1
if TYPE_CHECKING:  # pandas on first use: `hpt submit`/`status` start ~0.6 s sooner without it
    import pandas as pd

TERMINAL_SWEEP: tuple[str, ...] = tuple(s for s in SweepStatus if s not in ACTIVE)


class ApiError(RuntimeError):
    """A 4xx/5xx answer, or one the client cannot use (not JSON, a redirect, a reply of
    another shape: the server is not the hptransfer API); `status` 0: no answer. `errors`
    lists {field, message} where the server named fields."""

    def __init__(self, status: int, message: str, errors: list[dict] | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.errors = status, message, errors or []


# what the server's ids are made of (store/rows.new_id: hex); anything else in a URL
# path could name another route ("../health") or carry a query
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _path_id(sweep_id: str) -> str:
    if not isinstance(sweep_id, str) or not _ID.fullmatch(sweep_id):
        # cut: an id of 3,000 characters was echoed whole
        raise ValueError(f"no sweep with id {sweep_id!r:.60}: ids are 1 to 64 letters, "
                         "digits, - and _")
    return sweep_id


@dataclass(frozen=True)
class ReplyShape:
    """What a reply must be for the client to use it: a JSON object whose `keys` hold these
    types (a ReplyShape: checked in turn), `optional` ones only where present and not null; or,
    with `each`, a JSON list of such objects. A wrong service behind HPT_URL, or a proxy's
    own JSON, gave KeyErrors and TypeErrors from deep in the client instead."""

    name: str
    keys: Mapping[str, type | ReplyShape] = field(default_factory=dict)
    optional: Mapping[str, type | ReplyShape] = field(default_factory=dict)
    each: ReplyShape | None = None


_STAGE = ReplyShape("a stage", {"stage": str, "state": str, "done": int, "total": int,
                                "counts": dict})
SWEEP = ReplyShape("a sweep", {"id": str, "name": str, "status": str, "counts": dict,
                               "total": int, "done": int},
                   {"stages": ReplyShape("stages", each=_STAGE)})
SWEEPS = ReplyShape("a list of sweeps", each=SWEEP)
TRIAL_PAGE = ReplyShape("a page of trials",
                        {"items": ReplyShape("trials", each=ReplyShape("a trial")),
                         "total": int})
PLAN = ReplyShape("a plan", {"text": str}, {"ceiling": dict})
FITS = ReplyShape("a fit report", {"text": str, "tables": dict}, {"table_columns": dict})
HEALTH = ReplyShape("a health report", {"status": str})
ERROR = ReplyShape("an hptransfer error", {"error": str}, {"errors": ReplyShape(
    "errors", each=ReplyShape("a field error", {"field": str, "message": str}))})

_JSON_KINDS = ((dict, "a JSON object"), (list, "a JSON list"), (str, "a JSON string"),
               (bool, "a JSON boolean"), (int | float, "a JSON number"))
WRONG_SERVER = "is HPT_URL the hptransfer API?"
MEDIA_JSON = re.compile(r"application/(?:[\w.+-]+\+)?json")


def _kind(value: Any) -> str:
    return next((name for t, name in _JSON_KINDS if isinstance(value, t)), "JSON null")


def misfit(value: Any, shape: ReplyShape) -> str | None:
    """What keeps `value` (parsed JSON) from being `shape`, in words; None when it fits."""
    if shape.each is not None:
        if not isinstance(value, list):
            return _kind(value)
        why = next((w for item in value if (w := misfit(item, shape.each))), None)
        return f"a list holding {why}" if why else None
    if not isinstance(value, dict):
        return _kind(value)
    wanted = [*shape.keys.items(), *((k, t) for k, t in shape.optional.items()
                                     if value.get(k) is not None)]
    for key, want in wanted:
        if key not in value:
            return f"a JSON object without {key!r}"
        got = value[key]
        why = misfit(got, want) if isinstance(want, ReplyShape) else (
            None if isinstance(got, want) else _kind(got))
        if why:
            return f"a JSON object whose {key!r} is {why}"
    return None


def excerpt(text: str, limit: int = 200) -> str:
    """A short, one-line piece of a body to quote: an HTML page's <title>, else its text
    without tags (a proxy's 6 kB error page was printed whole as the error line)."""
    head = text[:100_000]
    title = re.search(r"<title[^>]*>(.*?)</title>", head, re.IGNORECASE | re.DOTALL)
    plain = " ".join((title.group(1) if title else re.sub(r"<[^>]*>", " ", head)).split())
    plain = redact(plain) or ""
    return plain if len(plain) <= limit else f"{plain[:limit]}..."


def _url_problem(url: str) -> str | None:
    """Why `url` cannot be the API's address, in words, or None (httpx said only
    "UnsupportedProtocol" at the first request)."""
    if "://" not in url:
        return f"it has no scheme: add http:// ({mask_url('http://' + url)})"
    if url.split("://", 1)[0].lower() not in ("http", "https"):
        return "the API is served over http:// or https://"
    try:
        urlsplit(url)
    except ValueError as exc:
        return f"it is not a valid URL ({exc})"
    return None


class Client:
    def __init__(self, url: str | None = None, token: str | None = None,
                 timeout: float = 60.0) -> None:
        self.url = (url or client_url(DEFAULT_URL)).rstrip("/")
        self.timeout = timeout
        if problem := _url_problem(self.url):
            raise ValueError(f"invalid server URL {mask_url(self.url)!r}: {problem}")
        token = token if token is not None else client_token()
        problem = token_problem(token) if token else None
        if problem:  # refused here: httpx would blame the URL
            raise ValueError(f"the API token {problem}; check --token or HPT_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        except (httpx.InvalidURL, ValueError) as exc:
            # httpx quotes the part it failed on, which may be a piece of the password
            why = (f": {exc}" if "@" not in self.url else ": a password holding '/', '?', "
                   "'#' or '@' must be percent-encoded (%2F, %3F, %23, %40)")
            raise ValueError(f"invalid server URL {mask_url(self.url)!r}{why}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, expect: ReplyShape, retries: int = 0,
              **kw: Any) -> Any:
        """The reply's JSON, checked to be `expect` (else an ApiError). `retries`: times to
        send the request again after no answer (only for a request the server deduplicates:
        a submit with its Idempotency-Key)."""
        where = mask_url(self.url)
        try:
            r = self._send(method, path, retries, **kw)
        except httpx.TimeoutException as exc:
            applied = ("; it may still have been applied: check `hpt status` before sending it "
                       "again" if method != "GET" else "")
            raise ApiError(0, f"no answer from {where} within {self.timeout:g} s "
                              f"({type(exc).__name__}){applied}") from None
        except httpx.ConnectError as exc:
            raise ApiError(0, f"cannot reach {where} ({redact(str(exc))}); is `hpt serve` "
                              "running?") from None
        except httpx.HTTPError as exc:  # the message may quote headers (the token): not shown
            raise ApiError(0, f"request to {where} failed ({type(exc).__name__})") from None
        body = _json_of(r, where)
        if r.status_code >= 400:
            if (why := misfit(body, ERROR)) is None:
                raise ApiError(r.status_code, body["error"], body.get("errors"))
            if isinstance(body, dict) and misfit(body, expect) is None:
                raise ApiError(r.status_code, excerpt(r.text, 1000))  # /health's 503: a report
            raise ApiError(r.status_code, _unexpected(r, where, why, ERROR))
        if why := misfit(body, expect):
            raise ApiError(r.status_code, _unexpected(r, where, why, expect))
        return body

    def _send(self, method: str, path: str, retries: int, **kw: Any) -> httpx.Response:
        resends_after_a_drop = max(retries, GET_RESENDS if method == "GET" else 0)
        attempt = 0
        while True:
            try:
                return self._http.request(method, path, **kw)
            except httpx.TimeoutException:
                if attempt >= retries:
                    raise
            except (httpx.NetworkError, httpx.RemoteProtocolError):
                if attempt >= resends_after_a_drop:
                    raise
            time.sleep(min(2.0, 0.25 * 2**attempt))
            attempt += 1

    # sweeps --------------------------------------------------------------------------
    def submit(self, spec: Any, confirm_cost: bool = False,
               idempotency_key: str | None = None) -> dict[str, Any]:
        """Submit a SweepSpec, a dict, a path to a YAML/JSON file, or YAML/JSON text.
        `confirm_cost`: queue it even if its estimate (`plan`) exceeds the server's
        HPT_MAX_SWEEP_DEVICE_HOURS (else that is an ApiError naming `confirm_cost`).
        Every submit carries an Idempotency-Key (`idempotency_key`, else a fresh one), so
        a request that got no answer is sent again (twice at most) without making a
        second sweep."""
        params = {"confirm_cost": "true"} if confirm_cost else None
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        return self._call("POST", "/sweeps", SWEEP, retries=SUBMIT_RETRIES,
                          json=_as_dict(spec), params=params, headers=headers)

    def plan(self, spec: Any, cpus: float | None = None, gpus: float | None = None,
             calibrate: bool = False) -> dict[str, Any]:
        """What the sweep would cost on the server's cluster (or on one of `cpus` and
        `gpus`), queueing nothing: per stage and in `total`, trials, tokens, FLOPs, peak
        memory per worker, workers per trial, device-hours and wall time; `throughput` says
        where the seconds per trial came from, `text` is the table `hpt plan` prints.
        `calibrate`: measure the throughput again."""
        params: dict[str, Any] = {"dry_run": "true"}
        if cpus is not None:
            params["cpus"] = cpus
        if gpus is not None:
            params["gpus"] = gpus
        if calibrate:
            params["calibrate"] = "true"
        return self._call("POST", "/sweeps", PLAN, json=_as_dict(spec), params=params)

    def get(self, sweep_id: str) -> dict[str, Any]:
        return self._call("GET", f"/sweeps/{_path_id(sweep_id)}", SWEEP)

    def list(self, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        """One page of sweeps, newest first (`list_all` pages through them all)."""
        return self._call("GET", "/sweeps", SWEEPS, params={"limit": limit, "offset": offset})

    def list_all(self, page: int = 1000) -> list[dict[str, Any]]:
        """Every sweep, newest first, paged through."""
        out: list[dict[str, Any]] = []
        while True:
            items = self.list(limit=page, offset=len(out))
            out.extend(items)
            if len(items) < page:
                return out

    def cancel(self, sweep_id: str) -> dict[str, Any]:
        # JSON content type: the server refuses mutations a cross-site form could send.
        return self._call("POST", f"/sweeps/{_path_id(sweep_id)}/cancel", SWEEP, json={})

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health", HEALTH)

    def trials(self, sweep_id: str, curves: bool = False, **filters: Any) -> pd.DataFrame:
        """All trials of a sweep (paged through) as a DataFrame, one row per trial; the
        same columns and numeric dtypes whether or not any row matched or has results.
        `curves`: each `result` with its loss curve (fetched 100 trials a request)."""
        import pandas as pd

        from hptransfer.contracts.filters import TRIAL_FILTER_NAMES
        from hptransfer.contracts.records import TRIAL_COLUMNS, TRIAL_NUMERIC_COLUMNS

        allowed = list(TRIAL_FILTER_NAMES)
        if unknown := sorted(set(filters) - set(allowed)):  # the API would ignore a typo
            raise TypeError(f"unknown trial filter {', '.join(unknown)}; filter by "
                            f"{', '.join(allowed)}")
        rows: list[dict] = []
        params = {k: v for k, v in filters.items() if v is not None}
        params["curves"] = "true" if curves else "false"
        path = f"/sweeps/{_path_id(sweep_id)}/trials"
        page_size = 100 if curves else 1000
        while True:
            page = self._call("GET", path, TRIAL_PAGE,
                              params={**params, "limit": page_size, "offset": len(rows)})
            rows.extend(page["items"])
            if not page["items"] or len(rows) >= page["total"]:
                break
        frame = pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))
        for column in TRIAL_NUMERIC_COLUMNS:  # None for every row: float NaN, not object
            if frame[column].dtype == object:
                frame[column] = pd.to_numeric(frame[column])
        return frame

    def fits(self, sweep_id: str, bootstrap: int = 100,
             reference_arm: str | None = None) -> dict[str, pd.DataFrame]:
        """The sweep's fit tables as DataFrames (optimal_lr, transfer, transfer_check,
        frontier, savings, aspect_ratio, chinchilla); `fits_raw` has the whole report, and
        for a study its `stages` (the stage each analysis came from) and `headline`."""
        import pandas as pd

        raw = self.fits_raw(sweep_id, bootstrap, reference_arm)
        columns = raw.get("table_columns") or {}
        # an empty table keeps its columns (`fits(...)["savings"]["reliable"]` always works)
        return {name: pd.DataFrame(rows, columns=columns.get(name) if not rows else None)
                for name, rows in raw["tables"].items()}

    def fits_raw(self, sweep_id: str, bootstrap: int = 100,
                 reference_arm: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"bootstrap": bootstrap}
        if reference_arm:
            params["reference_arm"] = reference_arm
        return self._call("GET", f"/sweeps/{_path_id(sweep_id)}/fits", FITS, params=params)

    def fits_text(self, sweep_id: str, bootstrap: int = 100) -> str:
        return self.fits_raw(sweep_id, bootstrap)["text"]

    def wait(self, sweep_id: str, poll: float = 1.0, timeout: float | None = None,
             progress: bool = True) -> dict[str, Any]:
        """Block until the sweep ends; a progress bar on stderr when `progress`."""
        from tqdm import tqdm

        start = time.time()
        bar = None
        shown = None
        try:
            while True:
                s = self.get(sweep_id)
                counts = {k: v for k, v in s["counts"].items() if v}
                if progress and shown != (s["total"], s["done"], counts):
                    # redraw only on change: piped into a log, every redraw is a new line
                    shown = (s["total"], s["done"], counts)
                    if bar is None:
                        bar = tqdm(total=s["total"], desc=s["name"], unit="trial",
                                   file=sys.stderr)
                    bar.total = s["total"]
                    bar.n = s["done"]
                    bar.set_postfix(counts, refresh=False)
                    bar.refresh()
                if s["status"] in TERMINAL_SWEEP:
                    return s
                if timeout is not None and time.time() - start > timeout:
                    raise TimeoutError(f"sweep {sweep_id} not finished after {timeout} s")
                time.sleep(poll)
        finally:
            if bar is not None:
                bar.close()


def _json_of(r: httpx.Response, where: str | None) -> Any:
    """The reply's JSON; an ApiError for a redirect (not followed: a login page, most
    likely) or a body that is not JSON (it was a bare JSONDecodeError)."""
    if r.is_redirect:
        to = excerpt(r.headers.get("location", ""))
        raise ApiError(r.status_code, f"the server at {where} answered {r.status_code} "
                                      f"{r.reason_phrase}, a redirect to {to!r}: "
                                      f"{WRONG_SERVER} (give the API's own address)")
    media = r.headers.get("content-type", "").split(";")[0].strip().lower()
    if not MEDIA_JSON.fullmatch(media):
        raise _refused(r, where, f"{media or 'no content-type'}, not JSON")
    try:
        return r.json()
    except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        raise _refused(r, where, "a body that is not valid JSON") from None


def _refused(r: httpx.Response, where: str | None, what: str) -> ApiError:
    quoted = excerpt(r.text)
    return ApiError(r.status_code, f"the server at {where} answered {r.status_code} "
                                   f"{r.reason_phrase} with {what}"
                                   + (f" ({quoted!r})" if quoted else "") + f": {WRONG_SERVER}")


def _unexpected(r: httpx.Response, where: str | None, why: str, expected: ReplyShape) -> str:
    return (f"the server at {where} answered {r.status_code} {r.reason_phrase} with {why} where "
            f"{expected.name} was expected ({excerpt(r.text)!r}): {WRONG_SERVER}")


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """A YAML/JSON spec file as a mapping; ValueError naming the file and what is wrong."""
    kind = _not_a_file(str(path))
    if kind:  # reading a pipe would wait for a writer forever
        raise ValueError(f"{path} is {kind}; give a spec file (YAML/JSON)")
    try:
        _check_size(Path(path))
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"no such file: {path}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    return _parse(text, str(path))


# Far above any spec (the server takes bodies up to HPT_MAX_REQUEST_BYTES, 1 MiB by
# default, and comments do not travel): a larger file is the wrong file, refused before a
# read that took 89 s and 620 MB for 200 MB
MAX_SPEC_FILE_BYTES = 64 * 2**20


def _check_size(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_SPEC_FILE_BYTES:
        raise ValueError(f"{path} is {_size(size)}; no spec is larger than "
                         f"{_size(MAX_SPEC_FILE_BYTES)}: is this the right file?")


def _size(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _parse(text: str, where: str) -> dict[str, Any]:
    """YAML/JSON text read as the server reads it (spec_text: a key given twice is an
    error, not the last one kept)."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where} is not valid YAML/JSON: "
                         f"{' '.join(str(exc).split())[:300]}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a sweep spec must be a mapping (YAML/JSON object)")
    return data


def _not_a_file(text: str) -> str | None:
    """What `text` names when it is a path to something other than a regular file."""
    try:
        path = Path(text)
        if not text or not path.exists() or path.is_file():  # Path("") is the working dir
            return None
        return "a directory" if path.is_dir() else "not a regular file (a device or a pipe)"
    except (OSError, ValueError):  # too long, or a NUL: not a path
        return None


def _as_dict(spec: Any) -> dict[str, Any]:
    if isinstance(spec, bytes | bytearray):  # a file's bytes: its text, not their repr
        try:
            spec = bytes(spec).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the spec's bytes are not UTF-8 text") from None
    if hasattr(spec, "model_dump"):
        data = spec.model_dump(mode="json")
    elif isinstance(spec, dict):
        data = spec
    elif isinstance(spec, Path) or looks_like_path(str(spec)):
        data = read_spec_file(spec)
    else:
        text = str(spec).strip()
        if "\n" not in text and not text.startswith("{") and ":" not in text:
            # one line that is neither a file nor a mapping: a path mistyped, most likely
            if kind := _not_a_file(text):
                raise ValueError(f"{text[:300]} is {kind}; give a spec file (YAML/JSON)")
            raise ValueError(f"no such file: {text[:300]} (nor is it a spec's YAML/JSON text)")
        data = _parse(str(spec), "the spec text")
    if nesting_depth(data) > MAX_NESTING:  # json.dumps would recurse out of stack
        raise ValueError(NESTED_TOO_DEEPLY)
    # JSON cannot carry them: the request could not be sent to be refused by field
    if bad := non_finite_paths(data):
        raise ValueError(f"{', '.join(bad)}: Infinity or NaN is not a value a spec field "
                         "accepts; give a finite number")
    return data
