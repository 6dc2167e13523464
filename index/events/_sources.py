"""Discovery of a vLLM worker's KV-event endpoints from ``GET /kv_event_sources``.

What a worker declares is untrusted: the call sends the worker's credentials and reads a
bounded answer, and a declared endpoint is subscribed only if it is on the worker's own host
(a ``*`` or ``0.0.0.0`` bind means that host; an ``ipc://`` path only for a worker on
loopback, which shares kvgate's host) or the router's allowlist admits it (the
``endpoint_allowed`` check, the one run-time workers' configured endpoints pass). Anything else
would let a worker point kvgate's subscribers at any host it likes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvgate.index._http import call_engine
from kvgate.index.api import Endpoints, EngineWorker
from kvgate.index.errors import (
    DiscoveryError,
    DiscoveryUnreachable,
    EngineCallError,
    JsonDecodeError,
)
from kvgate.index.jsonsafe import decode_json

log = logging.getLogger(__name__)

EndpointCheck = Callable[[str], Awaitable[bool]]
"""Whether kvgate may connect to a ZMQ endpoint a worker declared (the router's allowlist)."""

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]"}
_MAX_ANSWER_BYTES = 1 << 20  # a JSON object with one entry per data-parallel rank
_MAX_SOURCES = 256  # data-parallel ranks subscribed per worker (a socket and a task each)


def resolve_endpoint(endpoint: str, worker_url: str) -> str:
    """``tcp://*:5557`` → ``tcp://<worker host>:5557`` (a wildcard bind means the worker)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise DiscoveryError(f"not a ZMQ endpoint: {endpoint!r}")
    host, colon, port = rest.rpartition(":")
    if not colon or host not in _WILDCARD_HOSTS:
        return endpoint
    worker_host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in worker_host:
        worker_host = f"[{worker_host}]"
    return f"{scheme}://{worker_host}:{port}"


def parse_sources(body: Any, worker_url: str) -> list[Endpoints]:
    """One ``Endpoints`` per data-parallel rank that publishes over ZMQ with events enabled."""
    if not isinstance(body, Mapping):
        raise DiscoveryError("kv_event_sources: expected a JSON object keyed by rank")
    out: list[Endpoints] = []
    for rank_text, source in body.items():
        if not isinstance(source, Mapping):
            continue
        if not source.get("enable_kv_cache_events", True):
            continue
        if source.get("publisher", "zmq") != "zmq":
            continue
        endpoint = source.get("endpoint")
        if not isinstance(endpoint, str):
            continue
        try:
            rank = int(rank_text)
        except ValueError:
            continue
        replay = source.get("replay_endpoint")
        out.append(
            Endpoints(
                events=resolve_endpoint(endpoint, worker_url),
                replay=resolve_endpoint(replay, worker_url) if isinstance(replay, str) else None,
                dp_rank=rank,
            )
        )
    return sorted(out, key=lambda e: e.dp_rank)


_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def on_worker_host(endpoint: str, worker_url: str) -> bool:
    """A ``tcp://`` endpoint on the worker's own host (as its URL names it), or an ``ipc://``
    path declared by a worker on kvgate's own host (its URL is loopback)."""
    scheme, _, rest = endpoint.partition("://")
    worker_host = (urlsplit(worker_url).hostname or "").lower()
    if scheme == "ipc":
        return bool(rest) and worker_host in _LOOPBACK
    host = rest.rpartition(":")[0].strip("[]").lower()
    return scheme == "tcp" and bool(host) and host == worker_host


class Discovery:
    """Asks vLLM workers where they publish (``discover``), within the given bounds."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        timeout_s: float,
        endpoint_allowed: EndpointCheck | None = None,
    ) -> None:
        self._http = http
        self._timeout_s = timeout_s
        self._allowed = endpoint_allowed

    async def discover(self, worker: EngineWorker) -> list[Endpoints]:
        """The worker's allowed endpoints; ``DiscoveryUnreachable`` when it did not answer
        (yet), ``DiscoveryError`` when it publishes nothing kvgate may subscribe to."""
        path = "/kv_event_sources"
        try:
            status, body = await call_engine(
                self._http,
                worker,
                "GET",
                path,
                timeout_s=self._timeout_s,
                max_bytes=_MAX_ANSWER_BYTES,
            )
        except EngineCallError as error:
            raise DiscoveryUnreachable(str(error)) from error
        if status >= 500:
            raise DiscoveryUnreachable(f"GET {path}: HTTP {status}")
        if status != 200:
            raise DiscoveryError(f"GET {path}: HTTP {status}")
        try:
            sources = decode_json(body)
        except JsonDecodeError as error:
            raise DiscoveryError(f"GET {path}: {error}") from error
        declared = parse_sources(sources, worker.url)
        if len(declared) > _MAX_SOURCES:
            log.warning(
                "%s: declares %d ranks: the first %d", worker.id, len(declared), _MAX_SOURCES
            )
        endpoints = [e for e in declared[:_MAX_SOURCES] if await self._admits(worker, e)]
        if not endpoints:
            raise DiscoveryError(f"GET {path}: no ZMQ KV-event source kvgate may subscribe to")
        return endpoints

    async def _admits(self, worker: EngineWorker, endpoints: Endpoints) -> bool:
        for endpoint in (endpoints.events, endpoints.replay):
            if endpoint is None or on_worker_host(endpoint, worker.url):
                continue
            if self._allowed is None or not await self._allowed(endpoint):
                log.warning(
                    "%s: declares KV events at %s, not on its host nor allowed: not subscribed",
                    worker.id,
                    endpoint,
                )
                return False
        return True
