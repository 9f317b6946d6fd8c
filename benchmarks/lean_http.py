"""A lean keep-alive HTTP/1.1 client on raw asyncio streams, for load generation.

httpx.AsyncClient spends about a millisecond of CPU per request; on a small machine the
load generator then competes with the server it measures and the latencies are largely
the client's own. This client does only what a benchmark needs: one persistent connection
per simulated user, a request line and a few headers out, a status line, headers and a
Content-Length (or chunked) body back.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class HTTPError(RuntimeError):
    pass


class Connection:
    """One keep-alive connection to `host:port`; reopened when the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
        self._reader = self._writer = None

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """Send one request (`body`: JSON-encoded when given); return (status, body)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        payload = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        self._writer.write(head.encode() + b"\r\n" + payload)
        status, headers = await self._read_head()
        data = await self._read_body(headers)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, data

    async def get(self, path: str) -> tuple[int, bytes]:
        return await self.request("GET", path)

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        assert self._reader is not None
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise HTTPError(f"not an HTTP/1.x status line: {lines[0]!r}")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        assert self._reader is not None
        if "content-length" in headers:
            return await self._reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:  # no trailers: the server sends none
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await self._reader.readexactly(size + 2)  # the data and its CRLF
                if size == 0:
                    return b"".join(chunks)
                chunks.append(data[:-2])
        raise HTTPError("response without Content-Length or chunked encoding")
