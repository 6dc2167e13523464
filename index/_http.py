"""The index's own calls to engines (vLLM's ``GET /kv_event_sources`` and ``POST /tokenize``).

Answers from workers are untrusted: each call sends the worker's credentials, must be whole
within its timeout (a trickling worker cannot hold it), and is read up to a byte cap (a
worker cannot make kvgate buffer more); its JSON is decoded by the caller into a typed shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvgate.index.api import EngineWorker
from kvgate.index.errors import EngineCallError


async def call_engine(
    http: httpx.AsyncClient,
    worker: EngineWorker,
    method: str,
    path: str,
    *,
    timeout_s: float,
    max_bytes: int,
    json: Any = None,
) -> tuple[int, bytes]:
    """``method`` ``path`` on ``worker``: (status, body); ``EngineCallError`` without a whole
    answer of at most ``max_bytes`` within ``timeout_s``."""
    url = worker.url.rstrip("/") + path
    headers = {"accept-encoding": "identity"}  # the cap counts what the worker sends
    if worker.authorization is not None:
        headers["authorization"] = worker.authorization
    try:
        async with (
            asyncio.timeout(timeout_s),
            http.stream(method, url, headers=headers, json=json, timeout=timeout_s) as response,
        ):
            return response.status_code, await _body(response, max_bytes)
    except TimeoutError as error:
        raise EngineCallError(f"{method} {url}: no whole answer within {timeout_s:g} s") from error
    except httpx.HTTPError as error:
        raise EngineCallError(f"{method} {url}: {error!r}") from error


async def _body(response: httpx.Response, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise EngineCallError(f"{response.request.url}: answer over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
