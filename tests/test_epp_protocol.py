"""``kvgate epp`` over the ext_proc gRPC protocol, driven message by message by a real gRPC
peer (no Envoy): the Endpoint Picker Protocol's answers, health, and hostile peers (garbage
frames, wrong messages, oversized and never-ending bodies, silence), each costing its own
stream only. In front of simulated replicas (real HTTP, real KV events)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from fakes.epp import (
    Epp,
    Peer,
    channel,
    epp_server,
    request_body,
    request_headers,
    response_body,
    response_headers,
)
from fakes.simgate import MODEL, fleet_config, long_text, sim_fleets, until, worker_specs
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.router.epp import messages as pb
from kvgate.router.epp.wire import endpoint_of

pytestmark = pytest.mark.anyio

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"


@asynccontextmanager
async def running(replicas: int = 3, **overrides: Any) -> AsyncIterator[tuple[Epp, list[str]]]:
    async with (
        sim_fleets(fleet_config(replicas)) as (fleet,),
        epp_server(worker_specs(fleet), **overrides) as epp,
    ):
        yield epp, [r.url for r in fleet.replicas]


def chat_body(text: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


def set_headers(answer: Any) -> dict[str, str]:
    common = getattr(answer, answer.WhichOneof("response")).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def picked(answer: Any) -> list[str]:
    """The endpoints of a pick, checked to be the same in the header and the metadata."""
    assert answer.WhichOneof("response") == "request_headers", answer
    header = set_headers(answer)[DESTINATION]
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
    assert metadata.string_value == header
    return header.split(",")


async def pick(peer: Peer, body: bytes, **headers: Any) -> tuple[list[str], bytes]:
    """Send a request in full-duplex streamed mode; the endpoints and the body sent back."""
    await peer.send(request_headers(**headers))
    await peer.send(request_body(body[:10], end=False))
    await peer.send(request_body(body[10:], end=True))
    endpoints = picked(await peer.receive())
    sent = b""
    while True:
        answer = await peer.receive()
        streamed = answer.request_body.response.body_mutation.streamed_response
        sent += streamed.body
        if streamed.end_of_stream:
            return endpoints, sent


async def refusal(peer: Peer) -> tuple[int, dict[str, Any], dict[str, str]]:
    answer = await peer.receive()
    assert answer.WhichOneof("response") == "immediate_response", answer
    immediate = answer.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, json.loads(immediate.body)["error"], headers


async def answered_normally(epp: Epp) -> None:
    """A whole well-behaved exchange still works, and leaves no load behind."""
    async with channel(epp.grpc_port) as ch:
        peer = Peer(ch)
        endpoints, _ = await pick(peer, chat_body("still fine?", max_tokens=2))
        await peer.send(response_headers(200, endpoints[0]))
        assert (await peer.receive()).WhichOneof("response") == "response_headers"
        await peer.send(response_body(b'{"usage": {"prompt_tokens": 9}}', end=True))
        assert (await peer.receive()).WhichOneof("response") == "response_body"
        await peer.done_writing()
        assert await peer.receive() is None
    await until(epp.idle, what="the well-behaved exchange's load released")


# -- the protocol's answers ---------------------------------------------------------------


async def test_a_pick_names_the_chosen_endpoint_then_fallbacks_in_header_and_metadata() -> None:
    async with running(3) as (epp, urls), channel(epp.grpc_port) as ch:
        peer = Peer(ch)
        body = chat_body(long_text("pick me"), stream=True, max_tokens=3)
        endpoints, sent = await pick(peer, body)
        assert len(endpoints) == 3 == len(set(endpoints))  # 1 + upstream.max_failover
        assert set(endpoints) == {endpoint_of(u) for u in urls}
        # a stream whose client did not ask for usage: kvgate asks for it upstream
        assert json.loads(sent)["stream_options"] == {"include_usage": True}
        assert epp.in_flight() == 1  # counted on the chosen worker from the pick on
        chosen = next(w for w in epp.gateway.registry if endpoint_of(w.url) == endpoints[0])
        assert epp.sent(chosen.url) == 1
        await peer.send(response_headers(200, endpoints[0]))
        head = set_headers(await peer.receive())
        assert head["x-kvgate-worker"] == chosen.url
        events = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        counts = {"prompt_tokens": 30, "completion_tokens": 1}
        usage = {**counts, "prompt_tokens_details": {"cached_tokens": 0}}
        usage_event = b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
        await peer.send(response_body(events, end=False))
        first = (await peer.receive()).response_body.response.body_mutation.streamed_response
        assert first.body == events  # the answer passes through kvgate unchanged
        await peer.send(response_body(usage_event + b"data: [DONE]\n\n", end=True))
        last = (await peer.receive()).response_body.response.body_mutation.streamed_response
        assert last.end_of_stream and last.body == b"data: [DONE]\n\n"  # its usage hidden
        await peer.done_writing()
        assert await peer.receive() is None
        await until(epp.idle, what="the request's load released at the stream's end")
        labels = {"worker": chosen.url, "model": MODEL}
        assert epp.metric("kvgate_prompt_tokens_total", labels) == 30


async def test_the_subset_hint_restricts_the_pick_and_an_impossible_one_is_a_503() -> None:
    async with running(3) as (epp, urls), channel(epp.grpc_port) as ch:
        allowed = [endpoint_of(urls[2]), endpoint_of(urls[0])]
        hint = {"envoy.lb.subset_hint": {SUBSET: allowed}}
        endpoints, _ = await pick(Peer(ch), chat_body("hinted"), metadata=hint)
        assert set(endpoints) == set(allowed)
        peer = Peer(ch)
        nowhere = {
            "envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["10.9.9.9:1"]}
        }
        await peer.send(request_headers(metadata=nowhere))
        await peer.send(request_body(chat_body("nowhere")))
        status, error, headers = await refusal(peer)
        assert status == 503 and error["code"] == "no_healthy_worker"
        assert headers["content-type"] == "application/json" and "retry-after" in headers


async def test_a_fallback_that_served_moves_the_load_and_marks_the_skipped_worker() -> None:
    async with running(3) as (epp, _), channel(epp.grpc_port) as ch:
        peer = Peer(ch)
        endpoints, _ = await pick(peer, chat_body("fall back", stream=True))
        registry = epp.gateway.registry
        first, second = (
            next(w for w in registry if endpoint_of(w.url) == e) for e in endpoints[:2]
        )
        await peer.send(response_headers(200, endpoints[1]))
        head = set_headers(await peer.receive())
        assert head["x-kvgate-worker"] == second.url
        assert (epp.sent(first.url), epp.sent(second.url)) == (0, 1)
        assert first.consecutive_failures == 1
        labels = {"worker": first.url, "reason": "fallback"}
        assert epp.metric("kvgate_upstream_retries_total", labels) == 1
        peer.cancel()  # the client went: Envoy cancels the stream
        await until(epp.idle, what="the moved load released")


async def test_grpc_health_follows_the_ready_workers() -> None:
    async with running(2) as (epp, _), channel(epp.grpc_port) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def status(service: str) -> int:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            return int(reply.status)

        serving = health_pb2.HealthCheckResponse.SERVING
        services = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "")
        for service in services:
            assert await status(service) == serving
        registry = epp.gateway.registry
        for worker in list(registry):
            registry.record_failure(worker, "down for the test", immediate=True)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

        async def unready() -> bool:
            return await status("readiness") == not_serving

        await until(unready, what="readiness NOT_SERVING")
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == not_serving
        assert await status("liveness") == serving
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await status("no-such-service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_other_paths_are_passed_as_serve_passes_them() -> None:
    """Paths kvgate does not key go by load when serve's pass-through allowlist has them
    (a body-less one names its model in the query), else a 404."""
    async with running(2) as (epp, _), channel(epp.grpc_port) as ch:
        peer = Peer(ch)
        await peer.send(request_headers(f"/v1/embeddings?model={MODEL}", end=True))
        assert len(picked(await peer.receive())) == 2
        peer.cancel()
        peer = Peer(ch)
        await peer.send(request_headers("/v1/embeddings", end=True))
        status, error, _ = await refusal(peer)
        assert status == 400 and error["param"] == "model"
        peer = Peer(ch)
        await peer.send(request_headers("/v1/load_lora_adapter"))
        status, error, _ = await refusal(peer)
        assert status == 404 and error["code"] == "not_found"
        await until(epp.idle)


# -- hostile peers: each costs its own stream only ---------------------------------------


async def test_garbage_bytes_on_the_grpc_port_cost_only_their_connection() -> None:
    async with running(2) as (epp, _):
        for garbage in (
            b"\x00" * 64,
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(range(256)) * 8,
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", epp.grpc_port)
            writer.write(garbage)
            await writer.drain()
            async with asyncio.timeout(10):
                while await reader.read(4096):  # until the server closes it
                    pass
            writer.close()
        await answered_normally(epp)


async def test_a_message_that_is_not_a_processing_request_fails_its_rpc_only() -> None:
    async with running(2) as (epp, _), channel(epp.grpc_port) as ch:
        raw = ch.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=None,
            response_deserializer=None,
        )
        call = raw()
        await call.write(b"\xff\xff\xff\xff not protobuf")
        await call.done_writing()
        code = await call.code()
        assert code != grpc.StatusCode.OK
        await answered_normally(epp)


async def test_messages_out_of_order_end_the_stream_with_invalid_argument() -> None:
    async with running(2) as (epp, _), channel(epp.grpc_port) as ch:
        peer = Peer(ch)
        await peer.send(response_body(b"answer before any request", end=True))
        with pytest.raises(grpc.aio.AioRpcError) as first:
            await peer.receive()
        assert first.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        peer = Peer(ch)  # a second head after the pick
        await pick(peer, chat_body("twice"))
        await peer.send(request_headers())
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await peer.receive()
        assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await until(epp.idle, what="the broken stream's load released")
        assert epp.metric("kvgate_epp_streams_total", {"outcome": "protocol_error"}) == 2
        await answered_normally(epp)


async def test_an_oversized_body_is_a_413_and_a_huge_message_is_refused_by_grpc() -> None:
    async with running(2, max_body_bytes=4096) as (epp, _), channel(epp.grpc_port) as ch:
        peer = Peer(ch)
        await peer.send(request_headers())
        for _ in range(3):
            await peer.send(request_body(b"x" * 2000, end=False))
        status, error, _ = await refusal(peer)
        assert status == 413 and error["type"] == "invalid_request_error"
        peer = Peer(ch)
        await peer.send(request_headers())
        await peer.send(request_body(b"y" * (1 << 20), end=True))  # past gRPC's message limit
        with pytest.raises(grpc.aio.AioRpcError) as huge:
            await peer.receive()
        assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await answered_normally(epp)


async def test_silent_and_never_ending_requests_time_out_with_a_408() -> None:
    client = {"body_timeout_s": 0.5, "header_timeout_s": 0.5}
    async with running(2, client=client) as (epp, _), channel(epp.grpc_port) as ch:
        silent = Peer(ch)
        await silent.send(request_headers())
        status, error, _ = await refusal(silent)
        assert status == 408 and error["code"] is not None
        endless = Peer(ch)
        await endless.send(request_headers())

        async def drip() -> None:
            for _ in range(10_000):  # bounded: far past the body timeout at 1 ms a piece
                await endless.send(request_body(b" ", end=False))
                await asyncio.sleep(0.001)

        dripping = asyncio.create_task(drip())
        try:
            status, _, _ = await refusal(endless)
        finally:
            dripping.cancel()
        assert status == 408
        assert epp.metric("kvgate_epp_streams_total", {"outcome": "timeout"}) == 2
        await answered_normally(epp)


async def test_client_keys_are_checked_and_never_reach_the_engine_whose_own_key_is_sent() -> None:
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        epp_server(
            worker_specs(fleet, api_key="engine-secret"), api_keys=["client-secret-1"]
        ) as epp,
        channel(epp.grpc_port) as ch,
    ):
        peer = Peer(ch)
        await peer.send(request_headers())
        status, error, headers = await refusal(peer)
        assert status == 401 and error["type"] == "authentication_error"
        assert headers["www-authenticate"] == "Bearer"
        peer = Peer(ch)
        await peer.send(request_headers(extra={"authorization": "Bearer client-secret-1"}))
        await peer.send(request_body(chat_body("with my key")))
        answer = await peer.receive()
        picked(answer)
        mutation = answer.request_headers.response.header_mutation
        assert set_headers(answer)["authorization"] == "Bearer engine-secret"
        assert "x-api-key" in mutation.remove_headers
        peer.cancel()
        await until(epp.idle)


async def test_in_buffered_mode_kvgate_skips_the_body_of_answers_it_does_not_sample() -> None:
    """Request body buffered, answer streamed (deploy/envoy/envoy.yaml): one answer in
    ``answer_sample`` is read; the others' heads carry a mode override (no body, trailers
    sent, so the stream lasts until the request ends), and the stream's end releases them."""
    modes = (pb.BUFFERED, pb.STREAMED)
    async with running(answer_sample=2) as (epp, urls), channel(epp.grpc_port) as ch:
        overrides = []
        for number in range(2):
            peer = Peer(ch)
            await peer.send(request_headers(modes=modes))
            head = await peer.receive()
            assert head.WhichOneof("response") == "request_headers"
            await peer.send(request_body(chat_body(f"question {number}", stream=True)))
            pick = await peer.receive()
            assert pick.WhichOneof("response") == "request_body"
            endpoint = pick.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
            first = endpoint.string_value.split(",")[0]
            await peer.send(response_headers(200, served=first))
            answer = await peer.receive()
            assert answer.WhichOneof("response") == "response_headers"
            overrides.append(answer.HasField("mode_override"))
            if answer.HasField("mode_override"):
                mode = answer.mode_override
                assert (mode.response_body_mode, mode.response_trailer_mode) == (pb.NONE, pb.SEND)
                assert epp.in_flight() == 1  # held until the request ends
            else:  # the sampled one: its answer read as it streams
                await peer.send(response_body(b'data: {"choices": []}\n\n', end=False))
                assert (await peer.receive()).WhichOneof("response") == "response_body"
                await peer.send(response_body(b"data: [DONE]\n\n", end=True))
                assert (await peer.receive()).WhichOneof("response") == "response_body"
            await peer.done_writing()  # Envoy closes the stream at the request's end
            assert await peer.receive() is None
            await until(epp.idle, what="the request's load released at its stream's end")
        assert overrides == [True, False]
        labels = {"model": MODEL, "status": "200"}
        answered = sum(
            epp.metric("kvgate_requests_total", {**labels, "worker": url}) for url in urls
        )
        assert answered == 2


async def test_a_queued_request_is_dispatched_within_its_subset_hint() -> None:
    """The subset is part of the decision (``RequestFacts.allowed``): the queue's ranking
    at dispatch keeps to it too."""
    queue = {"max_in_flight_per_key": 1}
    async with running(3, queue=queue) as (epp, urls), channel(epp.grpc_port) as ch:
        first = Peer(ch)
        held, _ = await pick(first, chat_body("first in"))
        allowed = [endpoint_of(url) for url in urls if endpoint_of(url) != held[0]][:1]
        second = Peer(ch)
        await second.send(request_headers(metadata={"envoy.lb.subset_hint": {SUBSET: allowed}}))
        await second.send(request_body(chat_body("second, within the subset")))
        admission = epp.gateway.scheduler.queue
        await until(lambda: len(admission) == 1, what="the second request queued")
        await first.send(response_headers(200, served=held[0]))
        await first.receive()
        await first.send(response_body(b"data: [DONE]\n\n", end=True))
        await first.receive()
        await first.done_writing()  # the first ends: the second is dispatched
        assert picked(await second.receive()) == allowed
