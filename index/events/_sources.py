"""Discovery of a vLLM worker's KV-event endpoints from ``GET /kv_event_sources``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from index.errors import DiscoveryError, DiscoveryUnreachable
from index.events._subscriber import Endpoints

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]"}


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


async def discover(
    http: httpx.AsyncClient, worker_url: str, *, timeout_s: float
) -> list[Endpoints]:
    """Ask a vLLM worker where it publishes; ``DiscoveryError`` when it does not."""
    url = worker_url.rstrip("/") + "/kv_event_sources"
    try:
        response = await http.get(url, timeout=timeout_s)
    except httpx.HTTPError as error:
        raise DiscoveryUnreachable(f"GET {url}: {error!r}") from error
    if response.status_code >= 500:
        raise DiscoveryUnreachable(f"GET {url}: HTTP {response.status_code}")
    if response.status_code != 200:
        raise DiscoveryError(f"GET {url}: HTTP {response.status_code}")
    try:
        body = response.json()
    except ValueError as error:
        raise DiscoveryError(f"GET {url}: not JSON") from error
    endpoints = parse_sources(body, worker_url)
    if not endpoints:
        raise DiscoveryError(f"GET {url}: no ZMQ KV-event source enabled")
    return endpoints
