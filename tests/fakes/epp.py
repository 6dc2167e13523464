"""``kvgate epp`` (real uvicorn and a real gRPC server, in this event loop) and a real Envoy
(deploy/envoy/envoy.yaml through bench/envoy.py, a subprocess) in front of simulated
replicas, for the tests of kvgate as an endpoint picker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from fakes.gateway import quiet_health
from fakes.server import serve
from fakes.simgate import MODEL, worker_specs
from kvgate.backends.process import free_port
from kvgate.backends.sim.fleet import SimFleet
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.bench.envoy import Envoy, bootstrap
from kvgate.router.config import load_settings
from kvgate.router.epp import messages as pb
from kvgate.router.epp.app import create_epp_app
from kvgate.router.epp.config import EppSettings
from kvgate.router.epp.wire import endpoint_of
from kvgate.router.gateway import Gateway
from kvgate.router.serve import uvicorn_config


@dataclass
class Epp:
    """A running ``kvgate epp``: its HTTP side, gRPC port and parts."""

    url: str
    grpc_port: int
    gateway: Gateway
    client: httpx.AsyncClient

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.gateway.metrics_registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    def in_flight(self) -> int:
        """Requests kvgate counts on its workers (the scheduler's ledger)."""
        return sum(w.in_flight for w in self.gateway.scheduler.ledger)

    def sent(self, url: str) -> int:
        """Requests kvgate counts on the worker at ``url``."""
        worker = self.gateway.registry.get(url)
        return self.gateway.scheduler.ledger.of(worker).in_flight

    def idle(self) -> bool:
        """No load left on any worker, nothing queued or granted."""
        queue = self.gateway.scheduler.queue
        granted = sum(queue.in_flight_by_key().values())
        ledger = self.gateway.scheduler.ledger
        return (
            self.in_flight() == 0
            and all(w.pending_prefill_tokens == 0 and w.active_decode_blocks == 0 for w in ledger)
            and len(queue) == 0
            and granted == 0
        )


@asynccontextmanager
async def epp_server(workers: Sequence[str], **overrides: Any) -> AsyncIterator[Epp]:
    """``kvgate epp`` with the kv policy and the simulator's tokenizer, on free ports."""
    overrides.setdefault("health", quiet_health())
    overrides.setdefault("policy", "kv")
    overrides.setdefault("tokenizers", [f"{MODEL}={tokenizer_dir()}"])
    settings = load_settings(
        None, {"workers": list(workers), "grpc_port": 0, **overrides}, model=EppSettings
    )
    app = create_epp_app(settings)
    config = uvicorn_config(app, settings, log_level="warning", timeout_graceful_shutdown=2)
    async with (
        serve(app, config=config) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10.0) as client,
    ):
        yield Epp(server.url, app.state.grpc.port, app.state.gateway, client)


async def start_envoy(
    epp_ports: Sequence[int], pool: Sequence[str], work_dir: Path, name: str = "envoy"
) -> Envoy:
    """Envoy on free ports: ext_proc to ``epp_ports``, the pool of worker ``pool`` URLs."""
    config = bootstrap(
        listen_port=free_port(),
        admin_port=free_port(),
        epp=[f"127.0.0.1:{port}" for port in epp_ports],
        pool=[endpoint_of(url) for url in pool],
    )
    envoy = Envoy(config, work_dir, name=name)
    return await asyncio.to_thread(envoy.start)


@dataclass
class Stack:
    """Simulated replicas, ``kvgate epp`` and Envoy in front, and a client of Envoy."""

    fleet: SimFleet
    epp: Epp
    envoy: Envoy
    client: httpx.AsyncClient  # base_url: Envoy

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.fleet.replicas]


@asynccontextmanager
async def envoy_stack(fleet: SimFleet, work_dir: Path, **overrides: Any) -> AsyncIterator[Stack]:
    """(``answer_sample`` 1 unless given: kvgate reads every answer, as the tests of
    per-request usage, first tokens and cut answers need.)"""
    overrides.setdefault("answer_sample", 1)
    async with AsyncExitStack() as stack:
        epp = await stack.enter_async_context(epp_server(worker_specs(fleet), **overrides))
        urls = [r.url for r in fleet.replicas]
        envoy = await start_envoy([epp.grpc_port], urls, work_dir)
        stack.callback(envoy.stop)
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=envoy.url, timeout=30.0)
        )
        yield Stack(fleet, epp, envoy, client)


def openai_error(reply: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style error of a refusal (``{"error": {message, type, code}}``)."""
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    error: dict[str, Any] = reply.json()["error"]
    assert {"message", "type", "code"} <= error.keys(), error
    return error


# -- a direct ext_proc peer (no Envoy): the protocol's messages by hand --------------------


def header_map(headers: dict[str, str]) -> Any:
    return pb.HeaderMap(
        headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    path: str = "/v1/chat/completions",
    *,
    method: str = "POST",
    end: bool = False,
    extra: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
    modes: tuple[int, int] = (pb.FULL_DUPLEX_STREAMED, pb.FULL_DUPLEX_STREAMED),
) -> Any:
    """The first message of a stream, as Envoy sends it (by default in full-duplex streamed
    mode; ``modes``: the request's and the answer's body modes)."""
    headers = {":method": method, ":path": path, ":authority": "gw", **(extra or {})}
    config = pb.ProtocolConfiguration(request_body_mode=modes[0], response_body_mode=modes[1])
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end),
        protocol_config=config,
    )
    for namespace, fields in (metadata or {}).items():
        message.metadata_context.filter_metadata[namespace].update(fields)
    return message


def request_body(body: bytes, *, end: bool = True) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end))


def response_headers(status: int = 200, served: str | None = None) -> Any:
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map({":status": str(status)}))
    )
    if served is not None:
        lb = message.metadata_context.filter_metadata["envoy.lb"]
        lb.update({"x-gateway-destination-endpoint-served": served})
    return message


def response_body(body: bytes, *, end: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end))


class Peer:
    """One ext_proc stream to kvgate, driven message by message."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        process = channel.stream_stream(
            pb.PROCESS_METHOD,
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )
        self._call = process()

    async def send(self, message: Any) -> None:
        await self._call.write(message)

    async def receive(self, timeout_s: float = 10.0) -> Any:
        """The next answer; None when kvgate ended the stream."""
        answer = await asyncio.wait_for(self._call.read(), timeout_s)
        return None if answer is grpc.aio.EOF else answer

    async def done_writing(self) -> None:
        await self._call.done_writing()

    async def code(self) -> grpc.StatusCode:
        return await self._call.code()

    def cancel(self) -> None:
        self._call.cancel()


@asynccontextmanager
async def channel(port: int) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
