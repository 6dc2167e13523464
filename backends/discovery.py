"""DNS discovery of engine replicas behind a Kubernetes headless Service.

``--discover dns://vllm.ns.svc.cluster.local:8000`` names a DNS name whose A/AAAA records
are the engine pods (a headless Service answers with one record per ready pod). kvgate
re-resolves it every ``interval`` seconds with the event loop's own resolver
(``loop.getaddrinfo``: it runs in the loop's executor, never blocking the loop). Every
address becomes one worker ``http://ADDR:PORT``; its KV-events and replay endpoints are
derived from the configured ports (``tcp://ADDR:5557`` and ``tcp://ADDR:5558`` by default).

Options ride on the URL's query string so one flag carries everything::

    dns://vllm.ns.svc.cluster.local:8000?events_port=5557&replay_port=5558&engine=vllm&interval=5

``DnsDiscovery`` follows one name and reports changes through two async callbacks,
``on_added(DiscoveredWorker)`` and ``on_removed(url)``; ``DiscoveredFleet`` holds every
``--discover`` target of a gateway and maps those callbacks onto the gateway's own add and
remove operations (a removed worker is drained: in-flight requests finish; its index
entries are dropped). A failed resolution keeps the last
known set (a DNS hiccup never empties the fleet) and is counted; an address must be absent
from ``remove_after`` consecutive successful resolutions before it is reported removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Self, TypeVar, cast, get_args
from urllib.parse import parse_qsl, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvgate.backends.config import EngineKind, WorkerRole
from kvgate.backends.errors import DiscoveryUrlError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

AddressFamily = Literal["any", "ipv4", "ipv6"]

_FAMILIES: Mapping[AddressFamily, socket.AddressFamily] = {
    "any": socket.AF_UNSPEC,
    "ipv4": socket.AF_INET,
    "ipv6": socket.AF_INET6,
}
DEFAULT_EVENTS_PORT: int | None = 5557  # vLLM --kv-events-config endpoint tcp://*:5557
DEFAULT_REPLAY_PORT: int | None = 5558  # ... and its replay_endpoint tcp://*:5558
_NO_PORT = frozenset({"", "none", "off", "auto"})

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""Resolve ``(host, port)`` to the addresses found (any order, duplicates allowed).

Raises ``OSError`` (``socket.gaierror`` included) or ``TimeoutError`` when resolution fails.
"""

OnAdded = Callable[["DiscoveredWorker"], Awaitable[None]]
OnRemoved = Callable[[str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class DnsDiscoveryConfig:
    """What to resolve and how to turn each address into a worker."""

    host: str
    port: int
    scheme: Literal["http", "https"] = "http"
    engine: EngineKind = "vllm"
    role: WorkerRole = "both"
    events_port: int | None = DEFAULT_EVENTS_PORT
    replay_port: int | None = DEFAULT_REPLAY_PORT
    interval_s: float = 5.0
    timeout_s: float = 2.0
    # ipv4 by default: a dual-stack headless Service answers A and AAAA records for every
    # pod, and "any" would count each pod twice. IPv6-only clusters set family=ipv6.
    family: AddressFamily = "ipv4"
    remove_after: int = 2

    @property
    def target(self) -> str:
        """The ``host:port`` being resolved (the ``target`` label of the metrics)."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class DiscoveredWorker:
    """One engine replica found in DNS, in the terms of a static ``--worker`` entry."""

    url: str
    engine: EngineKind
    events: str | None  # KV events ZMQ PUB endpoint
    replay: str | None  # KV events replay ZMQ ROUTER endpoint
    address: str
    role: WorkerRole = "both"

    def worker_fields(self) -> dict[str, str | None]:
        """The ``backends.config.WorkerConfig`` fields of this replica (models: /v1/models)."""
        return {
            "url": self.url,
            "engine": self.engine,
            "role": self.role,
            "events": self.events,
            "replay": self.replay,
        }


def parse_discovery_url(url: str) -> DnsDiscoveryConfig:
    """Parse and validate ``dns://HOST:PORT[?option=value&...]``.

    Options: ``events_port``, ``replay_port`` (a port, or ``auto``/``none``: not derived; a
    vLLM worker's endpoints are then read from its ``GET /kv_event_sources``),
    ``engine`` (vllm | sglang | openai), ``role`` (prefill | decode | both: one Service
    per role in a disaggregated fleet), ``scheme`` (http | https), ``interval`` and
    ``timeout`` (seconds), ``family`` (any | ipv4 | ipv6), ``remove_after`` (rounds).
    """
    parts = urlsplit(url.strip())
    if parts.scheme != "dns":
        raise DiscoveryUrlError(
            f"discovery URL {url!r} must start with dns://, "
            "e.g. dns://vllm.ns.svc.cluster.local:8000"
        )
    if parts.username or parts.password or parts.path not in {"", "/"} or parts.fragment:
        raise DiscoveryUrlError(
            f"discovery URL {url!r}: only dns://HOST:PORT[?options] is accepted "
            "(no user, path or fragment)"
        )
    host = parts.hostname
    if not host:
        raise DiscoveryUrlError(f"discovery URL {url!r} has no host name")
    try:
        port = parts.port
    except ValueError as exc:
        raise DiscoveryUrlError(f"discovery URL {url!r}: invalid port ({exc})") from exc
    if port is None or port == 0:
        raise DiscoveryUrlError(
            f"discovery URL {url!r} needs the engines' HTTP port, e.g. dns://{host}:8000"
        )
    opts = _query_options(url, parts.query)

    def option(name: str, parse: Callable[[str], _T], default: _T) -> _T:
        raw = opts.get(name)
        if raw is None:
            return default
        try:
            return parse(raw)
        except ValueError as exc:
            raise DiscoveryUrlError(f"discovery URL {url!r}: option {name}: {exc}") from exc

    return DnsDiscoveryConfig(
        host=host,
        port=port,
        scheme=option("scheme", _parse_scheme, "http"),
        engine=option("engine", _parse_engine, "vllm"),
        role=option("role", _parse_role, "both"),
        events_port=option("events_port", _parse_optional_port, DEFAULT_EVENTS_PORT),
        replay_port=option("replay_port", _parse_optional_port, DEFAULT_REPLAY_PORT),
        interval_s=option("interval", _parse_seconds, 5.0),
        timeout_s=option("timeout", _parse_seconds, 2.0),
        family=option("family", _parse_family, "ipv4"),
        remove_after=option("remove_after", _parse_positive_int, 2),
    )


_OPTIONS = (
    "engine",
    "events_port",
    "family",
    "interval",
    "remove_after",
    "replay_port",
    "role",
    "scheme",
    "timeout",
)


def _query_options(url: str, query: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise DiscoveryUrlError(f"discovery URL {url!r}: malformed query ({exc})") from exc
    opts: dict[str, str] = {}
    for name, raw in pairs:
        if name not in _OPTIONS:
            raise DiscoveryUrlError(
                f"discovery URL {url!r}: unknown option {name!r} (known: {', '.join(_OPTIONS)})"
            )
        if name in opts:
            raise DiscoveryUrlError(f"discovery URL {url!r}: option {name!r} given twice")
        opts[name] = raw
    return opts


def _parse_optional_port(raw: str) -> int | None:
    if raw.strip().lower() in _NO_PORT:
        return None
    value = _parse_int(raw)
    if not 1 <= value <= 65535:
        raise ValueError(f"{raw!r} is not a port (1..65535, or auto)")
    return value


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not an integer") from None


def _parse_positive_int(raw: str) -> int:
    value = _parse_int(raw)
    if value < 1:
        raise ValueError(f"{raw!r} must be at least 1")
    return value


def _parse_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a number of seconds") from None
    if not 0.01 <= value <= 3600:
        raise ValueError(f"{raw!r} must be between 0.01 and 3600 seconds")
    return value


def _parse_engine(raw: str) -> EngineKind:
    for kind in get_args(EngineKind):
        if raw == kind:
            return cast(EngineKind, kind)
    raise ValueError(f"{raw!r} is not one of {', '.join(get_args(EngineKind))}")


def _parse_role(raw: str) -> WorkerRole:
    for role in get_args(WorkerRole):
        if raw == role:
            return cast(WorkerRole, role)
    raise ValueError(f"{raw!r} is not one of {', '.join(get_args(WorkerRole))}")


def _parse_family(raw: str) -> AddressFamily:
    for family in get_args(AddressFamily):
        if raw == family:
            return cast(AddressFamily, family)
    raise ValueError(f"{raw!r} is not one of {', '.join(get_args(AddressFamily))}")


def _parse_scheme(raw: str) -> Literal["http", "https"]:
    if raw == "http":
        return "http"
    if raw == "https":
        return "https"
    raise ValueError(f"{raw!r} is not one of http, https")


def _host_for_url(address: str) -> str:
    """An address as it goes in a URL: IPv6 in brackets, scope id kept."""
    return f"[{address}]" if ":" in address else address


def worker_for_address(config: DnsDiscoveryConfig, address: str) -> DiscoveredWorker:
    """The worker that one resolved address stands for."""
    host = _host_for_url(address)
    events = f"tcp://{host}:{config.events_port}" if config.events_port else None
    replay = f"tcp://{host}:{config.replay_port}" if config.replay_port else None
    return DiscoveredWorker(
        url=f"{config.scheme}://{host}:{config.port}",
        engine=config.engine,
        role=config.role,
        events=events,
        replay=replay,
        address=address,
    )


def loop_resolver(family: AddressFamily = "ipv4") -> Resolver:
    """A resolver on the running loop's ``getaddrinfo`` (executor thread, non-blocking)."""

    async def resolve(host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host, port, family=_FAMILIES[family], type=socket.SOCK_STREAM
        )
        return [str(info[4][0]) for info in infos]

    return resolve


def _normalise(addresses: list[str]) -> set[str]:
    """Canonical text per address (``::0001`` and ``::1`` are one worker)."""
    found: set[str] = set()
    for raw in addresses:
        text, _, scope = raw.partition("%")
        try:
            canonical = str(ipaddress.ip_address(text))
        except ValueError:
            logger.warning("discovery: resolver returned %r, not an IP address; ignored", raw)
            continue
        found.add(f"{canonical}%{scope}" if scope else canonical)
    return found


class DiscoveryMetrics:
    """Prometheus series of DNS discovery (one instance per registry, shared by targets)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.resolutions = Counter(
            "kvgate_discovery_resolutions_total",
            "DNS resolutions of a --discover target, by result (ok | error).",
            ["target", "result"],
            registry=registry,
        )
        self.workers = Gauge(
            "kvgate_discovery_workers",
            "Workers currently known from a --discover target.",
            ["target"],
            registry=registry,
        )
        self.changes = Counter(
            "kvgate_discovery_changes_total",
            "Workers added to or removed from the fleet by discovery.",
            ["target", "change"],
            registry=registry,
        )
        self.last_success = Gauge(
            "kvgate_discovery_last_success_timestamp_seconds",
            "Unix time of the last successful resolution of a --discover target.",
            ["target"],
            registry=registry,
        )
        self.failures = Counter(
            "kvgate_discovery_failures_total",
            "Steps of a --discover target lost to an error (added, removed: one worker's "
            "change, tried again next round; round: a whole round). The loop goes on.",
            ["target", "step"],
            registry=registry,
        )
        self.up = Gauge(
            "kvgate_discovery_up",
            "1 while the re-resolution loop of a --discover target runs, 0 once it stopped.",
            ["target"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class DiscoveryRound:
    """What one resolution changed."""

    ok: bool
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class DnsDiscovery:
    """Keeps a worker set in step with a DNS name; reports changes through callbacks.

    ``start()`` resolves once (so the first set is known before traffic) and then
    re-resolves every ``config.interval_s`` in a background task until ``stop()``.
    ``refresh()`` runs one round on demand. Callbacks are awaited in the loop: they
    should register/drain and return, not wait for a drain to finish. An exception from
    a callback costs that worker's change (logged, counted in
    ``kvgate_discovery_failures_total``, tried again next round), never the loop.
    """

    def __init__(
        self,
        config: DnsDiscoveryConfig,
        *,
        on_added: OnAdded,
        on_removed: OnRemoved,
        metrics: DiscoveryMetrics,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._on_added = on_added
        self._on_removed = on_removed
        self._metrics = metrics
        self._resolve = resolver or loop_resolver(config.family)
        self._clock = clock
        self._known: dict[str, DiscoveredWorker] = {}  # by address
        self._absent_rounds: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._target = config.target
        metrics.up.labels(self._target).set(0)
        metrics.workers.labels(self._target).set(0)
        for result in ("ok", "error"):
            metrics.resolutions.labels(self._target, result)
        for change in ("added", "removed"):
            metrics.changes.labels(self._target, change)
        for step in ("added", "removed", "round"):
            metrics.failures.labels(self._target, step)

    @property
    def workers(self) -> list[DiscoveredWorker]:
        """The workers currently known, sorted by URL."""
        return sorted(self._known.values(), key=lambda w: w.url)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("discovery already started")
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name=f"discovery {self._target}")
        self._task.add_done_callback(self._on_task_done)
        self._metrics.up.labels(self._target).set(1)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():  # a task that died already was logged by _on_task_done
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._metrics.up.labels(self._target).set(0)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    async def refresh(self) -> DiscoveryRound:
        """Resolve once and report the differences (serialised with the background loop)."""
        async with self._lock:
            addresses = await self._resolve_once()
            if addresses is None:
                return DiscoveryRound(ok=False)
            return await self._reconcile(addresses)

    async def _run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.config.interval_s)
                try:
                    await self.refresh()
                except Exception:  # the loop's supervisor: this round is lost, not the loop
                    self._metrics.failures.labels(self._target, "round").inc()
                    logger.exception("discovery of %s: a round failed", self._target)
        finally:
            self._metrics.up.labels(self._target).set(0)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "discovery of %s stopped: a callback failed",
                self._target,
                exc_info=task.exception(),
            )

    async def _resolve_once(self) -> set[str] | None:
        try:
            async with asyncio.timeout(self.config.timeout_s):
                raw = await self._resolve(self.config.host, self.config.port)
        except (OSError, TimeoutError) as exc:
            self._metrics.resolutions.labels(self._target, "error").inc()
            logger.warning(
                "discovery: resolving %s failed (%s); keeping %d known workers",
                self._target,
                exc or type(exc).__name__,
                len(self._known),
            )
            return None
        self._metrics.resolutions.labels(self._target, "ok").inc()
        self._metrics.last_success.labels(self._target).set(self._clock())
        return _normalise(raw)

    async def _reconcile(self, addresses: set[str]) -> DiscoveryRound:
        added = sorted(addresses - self._known.keys())
        for address in addresses:
            self._absent_rounds.pop(address, None)
        gone = [a for a in sorted(self._known) if a not in addresses]
        removed = [a for a in gone if self._count_absence(a) >= self.config.remove_after]
        for address in added:
            worker = worker_for_address(self.config, address)
            if not await self._report(self._on_added(worker), "added", worker.url):
                continue  # not known yet: reported again next round
            self._known[address] = worker
            self._metrics.changes.labels(self._target, "added").inc()
            logger.info("discovery: %s added worker %s", self._target, worker.url)
        for address in removed:
            worker = self._known[address]
            if not await self._report(self._on_removed(worker.url), "removed", worker.url):
                continue  # still known: reported again next round
            del self._known[address]
            self._absent_rounds.pop(address, None)
            self._metrics.changes.labels(self._target, "removed").inc()
            logger.info("discovery: %s removed worker %s", self._target, worker.url)
        self._metrics.workers.labels(self._target).set(len(self._known))
        return DiscoveryRound(
            ok=True,
            added=tuple(self._known[a].url for a in added if a in self._known),
            removed=tuple(
                worker_for_address(self.config, a).url for a in removed if a not in self._known
            ),
        )

    async def _report(self, change: Awaitable[None], step: str, url: str) -> bool:
        """Await one change's callback; False (logged, counted) when it failed."""
        try:
            await change
        except Exception:  # one worker's supervisor: its change is lost, not the round
            self._metrics.failures.labels(self._target, step).inc()
            logger.exception("discovery: %s: %s worker %s failed", self._target, step, url)
            return False
        return True

    def _count_absence(self, address: str) -> int:
        rounds = self._absent_rounds.get(address, 0) + 1
        self._absent_rounds[address] = rounds
        return rounds


AddWorker = Callable[[dict[str, str | None]], Awaitable[object]]
RemoveWorker = Callable[[str], Awaitable[object]]


class DiscoveredFleet:
    """Every ``--discover`` target of one gateway, wired to its add/remove operations.

    ``add`` receives ``DiscoveredWorker.worker_fields()`` (what ``POST /admin/workers``
    takes) and ``remove`` a worker URL (``DELETE /admin/workers/{id}``: the worker stops
    receiving requests, those in flight finish, its index entries go). ``exists`` tells
    whether a URL is already registered: such a worker (configured statically or through the
    admin API) is left alone, and only workers discovery added are ever removed by it.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        add: AddWorker,
        remove: RemoveWorker,
        exists: Callable[[str], bool],
        registry: CollectorRegistry,
        resolver: Resolver | None = None,
    ) -> None:
        self._add = add
        self._remove = remove
        self._exists = exists
        self.owned: set[str] = set()
        metrics = DiscoveryMetrics(registry)
        self.targets = [
            DnsDiscovery(
                parse_discovery_url(url),
                on_added=self._on_added,
                on_removed=self._on_removed,
                metrics=metrics,
                resolver=resolver,
            )
            for url in urls
        ]

    async def start(self) -> None:
        for target in self.targets:
            await target.start()

    async def stop(self) -> None:
        for target in self.targets:
            await target.stop()

    def hosts(self) -> list[str]:
        """The addresses of every worker the targets currently know."""
        return [worker.address for target in self.targets for worker in target.workers]

    async def _on_added(self, worker: DiscoveredWorker) -> None:
        if self._exists(worker.url):
            logger.info("discovery: %s is already registered; left as configured", worker.url)
            return
        self.owned.add(worker.url)
        await self._add(worker.worker_fields())

    async def _on_removed(self, url: str) -> None:
        if url not in self.owned:
            return
        self.owned.discard(url)
        if self._exists(url):
            await self._remove(url)
