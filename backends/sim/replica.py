"""One simulated replica: engine, KV-event publisher, HTTP server, adapters, stored
responses and faults."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import httpx
import xxhash
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvgate.backends.sim.api import ReplicaApp
from kvgate.backends.sim.cache import CacheSnapshot
from kvgate.backends.sim.config import SimConfig
from kvgate.backends.sim.engine import Engine
from kvgate.backends.sim.faults import (
    FAULT_KINDS,
    Fault,
    FaultError,
    FaultState,
    StandingKind,
    parse_fault,
)
from kvgate.backends.sim.lora import AdapterRegistry
from kvgate.backends.sim.metrics import LiveState, ReplicaMetrics
from kvgate.backends.sim.publisher import EventPublisher
from kvgate.backends.sim.responses import ResponseStore
from kvgate.backends.sim.server import HttpServer
from kvgate.backends.sim.tokenizer import SimTokenizer
from kvgate.backends.sim.transfer import Leases

_STANDING: tuple[str, ...] = get_args(StandingKind)
log = logging.getLogger(__name__)


def _seconds(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise FaultError(f"'{name}' must be a number >= 0")
    return float(value)


@dataclass(slots=True)
class SimRank:
    """One data-parallel rank of a replica: its own engine (cache, scheduler) and publisher."""

    dp_rank: int
    engine: Engine
    publisher: EventPublisher
    task: asyncio.Task[None] | None = None


class SimReplica:
    """A simulated vLLM replica. ``start``/``stop`` it; faults via ``apply_fault`` or methods."""

    def __init__(
        self,
        index: int,
        config: SimConfig,
        tokenizer: SimTokenizer,
        peer: Callable[[int], SimReplica],
    ) -> None:
        self.index = index
        self.config = config
        self.tokenizer = tokenizer
        self._peer = peer
        self.generation = 0
        self.started_at = int(time.time())
        self.registry = CollectorRegistry()
        self.faults = FaultState(random.Random(f"{config.seed}:{index}:faults"), time.monotonic)
        cfg = config.engine
        self.metrics = ReplicaMetrics(
            self.registry,
            cfg.model,
            LiveState(
                running=lambda: sum(len(r.engine.running) for r in self.ranks),
                waiting=lambda: sum(len(r.engine.waiting) for r in self.ranks),
                usage=lambda: sum(r.engine.cache.usage for r in self.ranks) / len(self.ranks),
                cpu_cached=lambda: sum(r.engine.cache.cpu_cached for r in self.ranks),
                event_seq=lambda: self.publisher.next_seq,
                busy_s=lambda: max(r.engine.busy_s for r in self.ranks),
                late_s=lambda: max(r.engine.late_s for r in self.ranks),
                ranks=lambda: [
                    (len(r.engine.running), len(r.engine.waiting), r.engine.cache.usage)
                    for r in self.ranks
                ],
            ),
            {
                "block_size": str(cfg.block_size),
                "num_gpu_blocks": str(cfg.capacity_blocks),
                "num_cpu_blocks": str(cfg.cpu_offload_blocks),
                "enable_prefix_caching": "True",
            },
            cpu_tier=cfg.cpu_offload_blocks > 0,
        )
        self.adapters = AdapterRegistry(cfg.model, cfg.lora_modules)
        self.leases = Leases()  # prefills kept for a remote decode (backends/sim/transfer.py)
        self._pull_client: httpx.AsyncClient | None = None
        self.responses = ResponseStore(config.api.responses_store, config.api.responses_store_bytes)
        self.ranks = [self._new_rank(rank) for rank in range(config.dp_size)]
        self.engine = self.ranks[0].engine  # rank 0 (the only one without data parallelism)
        self.publisher = self.ranks[0].publisher
        self._http = HttpServer(
            ReplicaApp(self), config.host, config.http_port(index), f"replica {index}"
        )
        self._background: set[asyncio.Task[Any]] = set()
        self._apply_startup_faults()

    # --- identity ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = self.config.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self._http.port}"

    @property
    def http_port(self) -> int:
        return int(self._http.port)

    @property
    def events_endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str:
        return self.publisher.replay_endpoint

    @property
    def http_up(self) -> bool:
        return self._http.up

    def _hash_seed(self) -> int:
        key = f"{self.config.seed}:{self.index}:{self.generation}"
        return xxhash.xxh3_64_intdigest(key.encode())

    def _new_rank(self, dp_rank: int) -> SimRank:
        config = self.config
        publisher = EventPublisher(
            config.events, self.faults, self.metrics, time.monotonic, dp_rank=dp_rank
        )
        seed = f"{config.seed}:{self.index}:tokens" + (f":{dp_rank}" if dp_rank else "")
        engine = Engine(
            config.engine,
            timing=config.timing,
            faults=self.faults,
            rng=random.Random(seed),
            hash_seed=self._hash_seed(),
            first_output_id=self.tokenizer.first_generated_id,
            on_batch=publisher.publish,
            observer=self.metrics,
        )
        return SimRank(dp_rank, engine, publisher)

    def engine_for(self, dp_rank: int | None) -> Engine:
        """The rank a request goes to: the one named (``X-data-parallel-rank``), else the
        least loaded (vLLM's own balance: waiting weighs 4, running 1), the lowest first."""
        if dp_rank is not None:
            return self.ranks[dp_rank].engine
        return min(
            self.ranks, key=lambda r: 4 * len(r.engine.waiting) + len(r.engine.running)
        ).engine

    def _apply_startup_faults(self) -> None:
        start = self.config.faults
        if start.fail_rate > 0:
            self.faults.set(Fault("fail", rate=start.fail_rate, value=500))
        if start.drop_events_rate > 0:
            self.faults.set(Fault("drop_events", rate=start.drop_events_rate))
        if start.event_delay_s > 0:
            self.faults.set(Fault("delay_events", value=start.event_delay_s))
        if start.slowdown != 1.0:
            self.faults.set(Fault("slow", value=start.slowdown))
        if start.prefill_slowdown != 1.0:
            self.faults.set(Fault("slow_prefill", value=start.prefill_slowdown))

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, ctx: zmq.asyncio.Context) -> None:
        cfg = self.config
        for rank in self.ranks:
            r = rank.dp_rank
            await rank.publisher.start(
                ctx, cfg.host, cfg.pub_port(self.index, r), cfg.replay_port(self.index, r)
            )
            rank.task = asyncio.create_task(rank.engine.run())
            rank.task.add_done_callback(self._engine_stopped(rank.engine))
        try:
            await self._http.start()
        except BaseException:
            await self.stop()
            raise

    def _engine_stopped(self, engine: Engine) -> Callable[[asyncio.Task[None]], None]:
        """A bug in the step loop must not leave clients waiting forever: fail them, loudly."""

        def stopped(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            error = task.exception()
            if error is not None:
                log.error("replica %d: engine loop died", self.index, exc_info=error)
                engine.fail_all(f"simulated engine crashed: {error!r}")

        return stopped

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        for rank in self.ranks:
            rank.engine.fail_all("replica stopped")
        await self._http.stop()
        for rank in self.ranks:
            if rank.task is not None:
                rank.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rank.task
                rank.task = None
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for rank in self.ranks:
            await rank.publisher.stop()
        if self._pull_client is not None:
            await self._pull_client.aclose()
            self._pull_client = None

    @property
    def pull_client(self) -> httpx.AsyncClient:
        """The HTTP client that pulls KV transfers from prefill replicas."""
        if self._pull_client is None:
            self._pull_client = httpx.AsyncClient(trust_env=False)
        return self._pull_client

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        """A fault action that failed (say, its port taken meanwhile) is logged, not lost."""
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("replica %d: fault action failed", self.index, exc_info=task.exception())

    # --- faults --------------------------------------------------------------------------

    def _cold_start(self, kind: str, drop: bool) -> None:
        """A new engine generation: requests fail, cache empty, new hash seed, event seq from
        0, stored responses gone (vLLM keeps them in the server process's memory)."""
        self.generation += 1
        self.metrics.on_fault(kind)
        for rank in self.ranks:
            rank.engine.restart(self._hash_seed(), f"engine restarted (simulated {kind})", drop)
            rank.publisher.reset()
        self.responses.clear()

    async def restart(self, downtime_s: float = 0.0) -> None:
        """Engine failure and restart: in-flight requests end with an error (an error event
        in a stream), then a cold start. With ``downtime_s`` > 0 the HTTP port refuses
        connections for that long."""
        self._cold_start("restart", drop=False)
        if downtime_s > 0:
            await self._http.stop()
            self._spawn(self._resume_after(downtime_s))

    async def crash(self, downtime_s: float = 0.0) -> None:
        """The process killed (SIGKILL) and started again cold: every connection is reset,
        requests in flight get no answer and no end of stream, the port refuses connections
        for ``downtime_s``, then a cold start."""
        self._cold_start("crash", drop=True)
        await self._http.stop()
        if downtime_s > 0:
            self._spawn(self._resume_after(downtime_s))
        else:
            await self._http.start()

    async def refuse(self, duration_s: float | None = None) -> None:
        """Stop listening (connections refused) until ``resume`` or for ``duration_s``.

        Requests in flight fail; the cache and the event stream are kept.
        """
        self.metrics.on_fault("refuse")
        for rank in self.ranks:
            rank.engine.fail_all("connection lost (simulated fault)")
        await self._http.stop()
        if duration_s is not None:
            self._spawn(self._resume_after(duration_s))

    async def resume(self) -> None:
        """Listen again after ``refuse`` (same port)."""
        await self._http.start()

    async def _resume_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.resume()

    def reset_prefix_cache(self) -> bool:
        return all([rank.engine.reset_prefix_cache() for rank in self.ranks])

    async def apply_fault(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The admin API (``POST /sim/fault``); ``replica`` may name another replica."""
        target = body.get("replica", self.index)
        if isinstance(target, bool) or not isinstance(target, int):
            raise FaultError("'replica' must be an integer")
        if target != self.index:
            return await self._peer(target).apply_fault({**body, "replica": target})
        kind = body.get("kind")
        if kind in _STANDING:
            fault = parse_fault(body, time.monotonic())
            self.faults.set(fault)
        elif kind == "clear":
            which = body.get("fault")
            if which is not None and which not in _STANDING:
                raise FaultError(f"'fault' must be one of {', '.join(_STANDING)}")
            self.faults.clear(which)
            for rank in self.ranks:
                if which in (None, "delay_events"):
                    rank.publisher.release_delayed()
                rank.engine.wake()
        elif kind == "reset_cache":
            return {"replica": self.index, "reset": self.reset_prefix_cache()}
        elif kind == "restart":
            downtime = _seconds(body, "downtime_s")
            if downtime:  # HTTP goes down: answer first, act right after
                self._spawn(self.restart(downtime))
            else:
                await self.restart()
        elif kind == "crash":  # every connection goes, this one too: answer first
            self._spawn(self.crash(_seconds(body, "downtime_s") or 0.0))
        elif kind == "refuse":
            self._spawn(self.refuse(_seconds(body, "duration_s")))
        elif kind == "resume":
            await self.resume()
        else:
            raise FaultError(f"'kind' must be one of {', '.join(FAULT_KINDS)}")
        return {"replica": self.index, "faults": self.faults.describe()}

    # --- introspection -------------------------------------------------------------------

    def snapshot(self, dp_rank: int = 0) -> CacheSnapshot:
        """The cached hashes per tier of one rank (what its published events must rebuild)."""
        return self.ranks[dp_rank].engine.cache.snapshot()

    def idle(self) -> bool:
        """No request queued or running (every event of finished work is published)."""
        return not any(r.engine.running or r.engine.waiting for r in self.ranks)

    def kv_event_sources(self) -> Any:
        ev = self.config.events
        sources = []
        for rank in self.ranks:
            endpoint = rank.publisher.endpoint.replace("0.0.0.0", "*")
            replay = rank.publisher.replay_endpoint.replace("0.0.0.0", "*")
            sources.append((rank.dp_rank, endpoint, replay))
        if ev.sources_format == "list":
            return [
                {
                    "data_parallel_rank": rank,
                    "endpoint": endpoint,
                    "replay_endpoint": replay,
                    "topic": ev.topic,
                }
                for rank, endpoint, replay in sources
            ]
        return {
            str(rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "buffer_steps": ev.buffer_steps,
                "hwm": ev.hwm,
                "max_queue_size": 100_000,
                "topic": ev.topic,
            }
            for rank, endpoint, replay in sources
        }

    def state(self) -> dict[str, Any]:
        engine, cache = self.engine, self.engine.cache
        return {
            "replica": self.index,
            "model": self.config.engine.model,
            "url": self.url,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "dp_size": len(self.ranks),
            "dp_ranks": [
                {
                    "dp_rank": r.dp_rank,
                    "events_endpoint": r.publisher.endpoint,
                    "replay_endpoint": r.publisher.replay_endpoint,
                    "running": len(r.engine.running),
                    "waiting": len(r.engine.waiting),
                    "gpu_cached_blocks": r.engine.cache.gpu_cached,
                }
                for r in self.ranks
            ],
            "generation": self.generation,
            "event_seq": self.publisher.next_seq,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "steps": engine.steps,
            "busy_s": engine.busy_s,
            "late_s": engine.late_s,
            "gpu_blocks": cache.num_blocks,
            "gpu_free_blocks": cache.free_blocks,
            "gpu_cached_blocks": cache.gpu_cached,
            "cpu_cached_blocks": cache.cpu_cached,
            "kv_cache_usage": cache.usage,
            "lora_adapters": [
                {"name": a.name, "lora_id": a.lora_id, "path": a.path} for a in self.adapters
            ],
            "stored_responses": len(self.responses),
            "faults": self.faults.describe(),
            "fault_hits": dict(self.faults.hits),
        }
