"""A fleet of simulated replicas in one process and one event loop (the Python API).

Example::

    config = SimConfig(replicas=2, port=0, events_port=0)   # 0: ephemeral ports
    async with SimFleet(config) as fleet:
        url, events, replay = fleet.replicas[0]
        fleet.replica(0).snapshot()                         # cache contents
        await fleet.replica(1).restart()                    # faults
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import NamedTuple

import zmq.asyncio

from kvgate.backends.sim.config import SimConfig
from kvgate.backends.sim.faults import FaultError
from kvgate.backends.sim.replica import SimReplica
from kvgate.backends.sim.tokenizer import SimTokenizer


class ReplicaEndpoints(NamedTuple):
    """Where one replica listens: HTTP base URL, KV-event PUB endpoint, replay endpoint."""

    url: str
    events: str
    replay: str


class SimFleet:
    """``config.replicas`` simulated replicas sharing one tokenizer and one ZMQ context."""

    def __init__(self, config: SimConfig | None = None, tokenizer: SimTokenizer | None = None):
        self.config = config if config is not None else SimConfig()
        self.config.validate()
        self._tokenizer = tokenizer
        self._replicas: list[SimReplica] = []
        self._ctx: zmq.asyncio.Context | None = None

    @property
    def tokenizer(self) -> SimTokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the fleet is not started")
        return self._tokenizer

    @property
    def replicas(self) -> list[ReplicaEndpoints]:
        return [
            ReplicaEndpoints(r.url, r.events_endpoint, r.replay_endpoint) for r in self._replicas
        ]

    def replica(self, index: int) -> SimReplica:
        """Replica ``index`` (its fleet index: ``config.first_replica`` is the first here)."""
        position = index - self.config.first_replica
        if not 0 <= position < len(self._replicas):
            held = self.config.indices
            runs = f"it runs {held.start}..{held.stop - 1}"
            raise FaultError(f"no replica {index} in this process ({runs})")
        return self._replicas[position]

    async def start(self) -> None:
        if self._ctx is not None:
            return
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(SimTokenizer.default)
        self._ctx = zmq.asyncio.Context()
        try:
            for i in self.config.indices:
                replica = SimReplica(i, self.config, self._tokenizer, self.replica)
                await replica.start(self._ctx)
                self._replicas.append(replica)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        replicas, self._replicas = self._replicas, []
        for replica in replicas:
            await replica.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
