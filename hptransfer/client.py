"""Python client for the hptransfer REST API."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import yaml

from hptransfer.config import client_token, client_url
from hptransfer.status import ACTIVE, SweepStatus

DEFAULT_URL = "http://127.0.0.1:8600"
TERMINAL_SWEEP: tuple[str, ...] = tuple(s for s in SweepStatus if s not in ACTIVE)


class ApiError(RuntimeError):
    """A 4xx/5xx answer; `errors` lists {field, message} where the server named fields."""

    def __init__(self, status: int, message: str, errors: list[dict] | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.errors = status, message, errors or []


class Client:
    def __init__(self, url: str | None = None, token: str | None = None,
                 timeout: float = 60.0) -> None:
        self.url = (url or client_url(DEFAULT_URL)).rstrip("/")
        token = token if token is not None else client_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach {self.url} ({exc}); is `hpt serve` running?") from exc
        if r.status_code >= 400:
            try:
                body = r.json()
                raise ApiError(r.status_code, body.get("error") or str(body), body.get("errors"))
            except ValueError:
                raise ApiError(r.status_code, r.text) from None
        return r.json()

    # sweeps --------------------------------------------------------------------------
    def submit(self, spec: Any) -> dict[str, Any]:
        """Submit a SweepSpec, a dict, a path to a YAML/JSON file, or YAML/JSON text."""
        return self._call("POST", "/sweeps", json=_as_dict(spec))

    def get(self, sweep_id: str) -> dict[str, Any]:
        return self._call("GET", f"/sweeps/{sweep_id}")

    def list(self, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        return self._call("GET", "/sweeps", params={"limit": limit, "offset": offset})

    def cancel(self, sweep_id: str) -> dict[str, Any]:
        # JSON content type: the server refuses mutations a cross-site form could send.
        return self._call("POST", f"/sweeps/{sweep_id}/cancel", json={})

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def trials(self, sweep_id: str, **filters: Any) -> pd.DataFrame:
        """All trials of a sweep (paged through) as a DataFrame, one row per trial."""
        rows: list[dict] = []
        params = {k: v for k, v in filters.items() if v is not None}
        while True:
            page = self._call("GET", f"/sweeps/{sweep_id}/trials",
                              params={**params, "limit": 1000, "offset": len(rows)})
            rows.extend(page["items"])
            if not page["items"] or len(rows) >= page["total"]:
                break
        return pd.DataFrame(rows)

    def fits(self, sweep_id: str, bootstrap: int = 100,
             reference_arm: str | None = None) -> dict[str, pd.DataFrame]:
        """The sweep's fit tables as DataFrames (optimal_lr, transfer, transfer_check,
        frontier, savings, aspect_ratio, chinchilla); `fits_raw` has the whole report, and
        for a study its `stages` (the stage each analysis came from) and `headline`."""
        raw = self.fits_raw(sweep_id, bootstrap, reference_arm)
        return {name: pd.DataFrame(rows) for name, rows in raw["tables"].items()}

    def fits_raw(self, sweep_id: str, bootstrap: int = 100,
                 reference_arm: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"bootstrap": bootstrap}
        if reference_arm:
            params["reference_arm"] = reference_arm
        return self._call("GET", f"/sweeps/{sweep_id}/fits", params=params)

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


def _as_dict(spec: Any) -> dict[str, Any]:
    if hasattr(spec, "model_dump"):
        return spec.model_dump(mode="json")
    if isinstance(spec, dict):
        return spec
    text = str(spec)
    if isinstance(spec, Path) or (len(text) < 4096 and "\n" not in text and Path(text).exists()):
        text = Path(text).read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("a sweep spec must be a mapping (YAML/JSON object)")
    return data
