"""The router-side queue (``scheduling.queue``) against real servers: simulated replicas
(paused: requests pile up in them) behind a real kvgate on 127.0.0.1. Every wait is on a
condition, never a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
from fakes.gateway import Kvgate, kvgate
from fakes.rawhttp import request_bytes
from fakes.wait import wait_until
from test_sim_support import fault, sim_config, sim_fleet

from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.router.accesslog import client_key_id
from kvgate.router.config import Settings, load_settings
from kvgate.router.flags import given_settings
from kvgate.router.logs import configure_logging
from kvgate.router.serve import build_parser
from kvgate.scheduling.capacity import KV_FIT, Parts
from kvgate.scheduling.config import Tuning
from kvgate.scheduling.dispatch_order import OrderConfig
from kvgate.scheduling.queue import AdmissionQueue

pytestmark = pytest.mark.anyio
MODEL = "kvgate-sim"
KEYS = ["key-one-secret", "key-two-secret"]
ONE, TWO = (client_key_id(key) for key in KEYS)  # their public ids (metric labels)


def _body(prompt: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}


ONE_AT_A_TIME = {"max_in_flight": 1}  # a worker with a request in flight takes no more
FIRST_COME = Tuning(order=OrderConfig(aging_tokens_per_s=0.001))  # no aging: cheapest first
ROOM_ONLY = {"max_pending_prefill_tokens": None}  # only KV room holds a worker back


def _queue(gw: Kvgate) -> AdmissionQueue:
    return gw.gateway.scheduler.queue


def _flights(gw: Kvgate) -> list[int]:
    """Requests in flight on each worker (the scheduler's ledger), in the workers' order."""
    return [e.in_flight for e in gw.gateway.scheduler.ledger]


def _flights_by_url(gw: Kvgate) -> dict[str, int]:
    return {e.worker.url: e.in_flight for e in gw.gateway.scheduler.ledger}


@asynccontextmanager
async def _setup(queue: dict[str, Any], **overrides: Any) -> AsyncIterator[tuple[Kvgate, str]]:
    """One simulated replica behind kvgate (``queue`` settings), replica URL."""
    async with sim_fleet(sim_config(replicas=1, speedup=1000.0)) as fleet:
        url = fleet.replicas[0].url
        overrides.setdefault("kv_index", False)
        async with kvgate([f"{url},models={MODEL}"], queue=queue, **overrides) as gw:
            yield gw, url


@asynccontextmanager
async def _paused(url: str) -> AsyncIterator[None]:
    """The replica runs no engine step inside the block (requests accepted, held)."""
    async with httpx.AsyncClient(base_url=url) as sim:
        await fault(sim, kind="pause")
        try:
            yield
        finally:
            await fault(sim, kind="clear")


def _send(gw: Kvgate, body: dict[str, Any], **headers: str) -> asyncio.Task[httpx.Response]:
    return asyncio.ensure_future(gw.client.post("/v1/completions", json=body, headers=headers))


async def _in_flight(gw: Kvgate, n: int) -> None:
    await wait_until(lambda: sum(_flights(gw)) == n, what="in flight")


async def _queued(gw: Kvgate, n: int) -> None:
    await wait_until(lambda: len(_queue(gw)) == n, what=f"{n} queued")


def with_kv_fit(tuning: Tuning | None) -> Tuning:
    """``tuning`` with the KV-room rule and answers' blocks on (off by default): the small
    caches' tests are about them."""
    tuning = tuning or Tuning()
    if tuning.parts == Parts():
        tuning = replace(tuning, parts=KV_FIT)
    return tuning


@asynccontextmanager
async def _small_caches(
    queue: dict[str, Any],
    replicas: int = 2,
    scheduling: dict[str, Any] | None = None,
    tuning: Tuning | None = None,
) -> AsyncIterator[tuple[Kvgate, list[str]]]:
    """Simulated replicas (two) of 64 KV blocks of 4 tokens behind kvgate (``kv`` policy,
    the real tokenizer and index, ``queue`` and ``scheduling`` settings), and the replica
    URLs."""
    tokenizers = [f"{MODEL}={tokenizer_dir()}"]
    config = sim_config(replicas=replicas, speedup=1000.0, block_size=4, capacity_blocks=64)
    async with sim_fleet(config) as fleet:
        urls = [r.url for r in fleet.replicas]
        workers = [f"{u},models={MODEL}" for u in urls]
        async with kvgate(
            workers,
            queue=queue,
            policy="kv",
            tokenizers=tokenizers,
            kv_index=True,
            # the sims' capacity (no scrape here)
            scheduling={"kv_capacity_blocks": 64, **(scheduling or {})},
            tuning=with_kv_fit(tuning),
        ) as gw:
            yield gw, urls


async def _hold_each(gw: Kvgate, repeats: int) -> list[asyncio.Task[httpx.Response]]:
    """One request in flight on each (paused) replica, of ``repeats`` x 6 prompt tokens."""
    held = []
    replicas = len(gw.gateway.registry)
    for n in range(1, replicas + 1):
        held.append(_send(gw, _body(" ".join([f"held number {n} waiting"] * repeats))))
        await _in_flight(gw, n)
    assert _flights(gw) == [1] * replicas
    return held


def _error(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    return error


async def test_light_load_never_queues() -> None:
    """Default thresholds: sequential and concurrent requests go straight through."""
    async with _setup({}) as (gw, _):
        for _ in range(3):
            assert (await gw.client.post("/v1/completions", json=_body())).status_code == 200
        replies = await asyncio.gather(*(_send(gw, _body(f"request {i}")) for i in range(8)))
        assert [r.status_code for r in replies] == [200] * 8
        assert gw.metric("kvgate_queue_entered_total", {"key": "-"}) == 0
        explained = (await gw.client.post("/debug/route", json=_body())).json()
        assert explained["admission"]["would_queue"] is False
        assert explained["admission"]["busy_workers"] == {}


async def test_full_queue_is_a_429_and_the_queued_request_is_sent_when_a_worker_frees() -> None:
    async with _setup({"max_length": 1}, scheduling=ONE_AT_A_TIME) as (gw, url):
        async with _paused(url):
            first = _send(gw, _body("first"))
            await _in_flight(gw, 1)
            second = _send(gw, _body("second"))
            await _queued(gw, 1)
            explained = (await gw.client.post("/debug/route", json=_body())).json()["admission"]
            assert explained["would_queue"] is True
            assert "queued ahead" in explained["reason"]
            assert list(explained["busy_workers"]) == [url]
            third = await gw.client.post("/v1/completions", json=_body("third"))
            assert third.status_code == 429
            assert third.headers["retry-after"] == "1"
            error = _error(third)
            assert error["code"] == "queue_full"
            assert error["type"] == "rate_limit_error"
            assert sum(_flights(gw)) == 1  # second still held here
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        assert len(_queue(gw)) == 0
        assert gw.metric("kvgate_queue_rejected_total", {"key": "-", "reason": "queue_full"}) == 1
        assert gw.metric("kvgate_queue_wait_seconds_count", {"key": "-"}) == 1
        metrics = (await gw.client.get("/metrics")).text
        assert "kvgate_queue_wait_seconds_bucket" in metrics


async def test_deadline_is_a_503_from_the_client_timeout_or_the_configured_one() -> None:
    async with _setup({"max_wait_s": 0.2}, scheduling=ONE_AT_A_TIME) as (gw, url):
        async with _paused(url):
            first = _send(gw, _body("first"))
            await _in_flight(gw, 1)
            late = await gw.client.post(
                "/v1/completions", json=_body("late"), headers={"x-request-timeout": "0.05"}
            )
            assert late.status_code == 503
            assert late.headers["retry-after"] == "1"
            assert _error(late)["code"] == "queue_timeout"
            configured = await gw.client.post("/v1/completions", json=_body("configured"))
            assert configured.status_code == 503
            assert _error(configured)["type"] == "service_unavailable_error"
            bad = await gw.client.post(
                "/v1/completions", json=_body(), headers={"x-stainless-timeout": "soon"}
            )
            assert bad.status_code == 400
            assert _error(bad)["param"] == "x-stainless-timeout"
            assert len(_queue(gw)) == 0
        assert (await first).status_code == 200
        labels = {"key": "-", "reason": "deadline"}
        assert gw.metric("kvgate_queue_rejected_total", labels) == 2


async def test_the_access_log_says_how_long_each_request_waited_in_the_queue() -> None:
    """``queued_ms``: null for a request sent at once, the wait for one dispatched from the
    queue, and the wait until its deadline for one refused there (503)."""
    stream = io.StringIO()
    output = configure_logging("info", "json", stream)
    try:
        async with _setup({"max_wait_s": 30}, scheduling=ONE_AT_A_TIME) as (gw, url):
            async with _paused(url):
                first = _send(gw, _body("first"), **{"x-request-id": "first"})
                await _in_flight(gw, 1)
                late = await gw.client.post(
                    "/v1/completions",
                    json=_body("late"),
                    headers={"x-request-timeout": "0.05", "x-request-id": "late"},
                )
                assert late.status_code == 503
                second = _send(gw, _body("second"), **{"x-request-id": "second"})
                await _queued(gw, 1)
            assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    finally:
        output.close()  # every queued line written
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    queued = {
        line["request_id"]: line["queued_ms"] for line in lines if line["logger"] == "kvgate.access"
    }
    assert queued["first"] is None
    assert queued["late"] >= 40  # its 0.05 s deadline (a timer may fire a little early)
    assert queued["second"] > 0


async def test_a_client_that_disconnects_while_queued_is_removed_at_once() -> None:
    async with _setup({}, scheduling=ONE_AT_A_TIME) as (gw, url):
        async with _paused(url):
            first = _send(gw, _body("first", stream=True))
            await _in_flight(gw, 1)
            host, port = gw.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = httpx.Request("POST", "/", json=_body("leaving", stream=True)).read()
            writer.write(
                request_bytes(
                    "POST",
                    "/v1/completions",
                    headers=[("content-type", "application/json")],
                    body=body,
                )
            )
            await writer.drain()
            await _queued(gw, 1)
            writer.close()
            await writer.wait_closed()
            await _queued(gw, 0)  # gone from the queue while the replica is still paused
            labels = {"key": "-", "reason": "client_gone"}
            assert gw.metric("kvgate_queue_rejected_total", labels) == 1
            assert sum(_flights(gw)) == 1
            assert await reader.read() == b""  # nothing was ever written to it
        assert (await first).status_code == 200
        await _in_flight(gw, 0)
        ok = {"worker": url, "model": MODEL, "status": "200"}
        assert gw.metric("kvgate_requests_total", ok) == 1  # the leaver never reached it


async def test_streaming_client_sees_nothing_until_dispatched() -> None:
    async with _setup({}, scheduling=ONE_AT_A_TIME) as (gw, url):
        async with _paused(url):
            first = _send(gw, _body("first"))
            await _in_flight(gw, 1)
            got_headers = asyncio.Event()

            async def stream() -> list[str]:
                async with gw.client.stream(
                    "POST", "/v1/completions", json=_body("streamed", stream=True)
                ) as reply:
                    got_headers.set()
                    assert reply.status_code == 200
                    return [line async for line in reply.aiter_lines() if line]

            streamed = asyncio.ensure_future(stream())
            await _queued(gw, 1)
            assert not got_headers.is_set()  # queued: not even the status line was sent
        assert (await first).status_code == 200
        lines = await streamed
        assert lines[-1] == "data: [DONE]"


async def test_one_key_cannot_take_the_queue_or_the_fleet() -> None:
    """Per-key concurrency and queue limits: key one's burst waits or is refused while key
    two's request goes through; keys are labelled by their public id, never the key."""
    queue = {"max_in_flight_per_key": 1, "max_queued_per_key": 2}
    async with _setup(queue, api_keys=KEYS) as (gw, url):
        one = {"authorization": f"Bearer {KEYS[0]}"}
        two = {"authorization": f"Bearer {KEYS[1]}"}
        async with _paused(url):
            burst = [_send(gw, _body(f"one {i}"), **one) for i in range(3)]
            await _in_flight(gw, 1)
            await _queued(gw, 2)
            refused = await gw.client.post("/v1/completions", json=_body("one more"), headers=one)
            assert refused.status_code == 429
            assert _error(refused)["code"] == "key_queue_full"
            other = _send(gw, _body("two"), **two)
            await _in_flight(gw, 2)  # key two reached the replica past key one's queued burst
            assert len(_queue(gw)) == 2
            assert _queue(gw).in_flight_by_key() == {ONE: 1, TWO: 1}
            metrics = (await gw.client.get("/metrics")).text
            assert f'kvgate_queue_length{{key="{ONE}",model="kvgate-sim"}} 2.0' in metrics
            assert KEYS[0] not in metrics and KEYS[1] not in metrics
        replies = await asyncio.gather(*burst, other)
        assert [r.status_code for r in replies] == [200] * 4
        assert gw.metric("kvgate_queue_entered_total", {"key": ONE}) == 2
        labels = {"key": ONE, "reason": "key_queue_full"}
        assert gw.metric("kvgate_queue_rejected_total", labels) == 1


async def _completion_order(
    gw: Kvgate,
    sends: list[tuple[str, dict[str, Any], dict[str, str]]],
    release: Callable[[], Awaitable[None]],
) -> list[str]:
    done: list[str] = []

    async def one(name: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        reply = await gw.client.post("/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        done.append(name)

    tasks = []
    for queued, (name, body, headers) in enumerate(sends):
        tasks.append(asyncio.ensure_future(one(name, body, headers)))
        await _queued(gw, queued + 1)  # arrival order is the order sent
    await release()
    await asyncio.gather(*tasks)
    return done


async def test_cheapest_first_but_a_sessions_turns_in_order() -> None:
    """Queued: a long turn 1 of session s, its short turn 2, a short other request. The
    other (cheapest head) goes first; turn 2, cheaper still, waits for turn 1."""
    tokenizers = [f"{MODEL}={tokenizer_dir()}"]
    async with _setup(
        {},
        scheduling=ONE_AT_A_TIME,
        tuning=FIRST_COME,
        kv_index=True,
        policy="kv",
        tokenizers=tokenizers,
    ) as (gw, url):
        long_prompt = " ".join(["many words of a long history"] * 60)
        s = {"x-session-id": "s"}
        async with httpx.AsyncClient(base_url=url) as sim:
            await fault(sim, kind="pause")
            blocker = _send(gw, _body("blocker"))
            await _in_flight(gw, 1)

            async def release() -> None:
                await fault(sim, kind="clear")

            order = await _completion_order(
                gw,
                [
                    ("turn 1", _body(long_prompt), s),
                    ("turn 2", _body("short"), s),
                    ("other", _body("brief"), {}),
                ],
                release,
            )
        assert (await blocker).status_code == 200
        assert order == ["other", "turn 1", "turn 2"]


async def test_dispatch_goes_to_the_worker_free_at_that_moment() -> None:
    """Two replicas, one request each in flight: the queued request goes to whichever frees
    up first, decided when it does."""
    async with sim_fleet(sim_config(replicas=2, speedup=1000.0)) as fleet:
        urls = [r.url for r in fleet.replicas]
        workers = [f"{u},models={MODEL}" for u in urls]
        async with kvgate(workers, scheduling=ONE_AT_A_TIME, kv_index=False) as gw:
            async with _paused(urls[0]):
                async with _paused(urls[1]):
                    held = [_send(gw, _body(f"held {i}")) for i in range(2)]
                    await _in_flight(gw, 2)
                    queued = _send(gw, _body("queued"))
                    await _queued(gw, 1)
                reply = await queued  # the second replica runs again, the first is paused
                assert reply.status_code == 200
                assert reply.headers["x-kvgate-worker"] == urls[1]
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


async def test_model_limits_hold_requests_even_with_a_free_worker() -> None:
    queue = {"max_in_flight_per_model": 1, "max_queued_per_model": 1}
    async with _setup(queue) as (gw, url):
        async with _paused(url):
            first = _send(gw, _body("first"))
            await _in_flight(gw, 1)
            second = _send(gw, _body("second"))
            await _queued(gw, 1)
            explained = (await gw.client.post("/debug/route", json=_body())).json()["admission"]
            assert explained["busy_workers"] == {}  # the worker is free: the model's limit holds
            third = await gw.client.post("/v1/completions", json=_body("third"))
            assert third.status_code == 429
            assert _error(third)["code"] == "model_queue_full"
        assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]


async def test_queued_requests_get_a_503_when_kvgate_stops() -> None:
    async with _setup({}, scheduling=ONE_AT_A_TIME) as (gw, url):
        async with _paused(url):
            first = _send(gw, _body("first"))
            await _in_flight(gw, 1)
            second = _send(gw, _body("second"))
            await _queued(gw, 1)
            _queue(gw).stop()
            reply = await second
            assert reply.status_code == 503
            assert _error(reply)["code"] == "queue_timeout"
            assert len(_queue(gw)) == 0
        assert (await first).status_code == 200


def test_queue_settings_have_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--scheduling-max-in-flight", "3", "--no-queue-enabled", "--queue-max-length", "7"]
    namespace = build_parser().parse_args(args)
    settings = load_settings(None, given_settings(namespace, Settings))
    assert (settings.scheduling.max_in_flight, settings.queue.enabled) == (3, False)
    assert settings.queue.max_length == 7
    monkeypatch.setenv("KVGATE_QUEUE__MAX_WAIT_S", "2.5")
    assert load_settings().queue.max_wait_s == 2.5
    assert load_settings().scheduling.max_pending_prefill_tokens == 65536


def test_moved_queue_settings_keep_their_old_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The busy limits moved to ``scheduling``: the old flags and variables still set them."""
    namespace = build_parser().parse_args(["--queue-busy-in-flight", "3"])
    settings = load_settings(None, given_settings(namespace, Settings))
    assert settings.scheduling.max_in_flight == 3
    monkeypatch.setenv("KVGATE_QUEUE__BUSY_PENDING_PREFILL_TOKENS", "4096")
    assert load_settings().scheduling.max_pending_prefill_tokens == 4096


async def test_a_free_worker_takes_the_request_cheapest_there_not_a_turn_cached_elsewhere() -> None:
    """Cache-affine dispatch: the worker that frees up holds nothing of a queued turn's
    history (cached on a busy replica), so a new request that costs it less goes first,
    although the turn (queued earlier) is the cheaper one on its own home."""
    tokenizers = [f"{MODEL}={tokenizer_dir()}"]
    history = " ".join(["the long shared history of one session"] * 40)
    async with sim_fleet(sim_config(replicas=2, speedup=1000.0, block_size=16)) as fleet:
        urls = [r.url for r in fleet.replicas]
        workers = [f"{u},models={MODEL}" for u in urls]
        async with kvgate(
            workers,
            scheduling=ONE_AT_A_TIME,
            tuning=FIRST_COME,
            policy="kv",
            tokenizers=tokenizers,
            kv_index=True,
        ) as gw:
            s = {"x-session-id": "s"}
            first = await gw.client.post("/v1/completions", json=_body(history), headers=s)
            home = first.headers["x-kvgate-worker"]
            other = next(u for u in urls if u != home)
            async with (
                httpx.AsyncClient(base_url=home) as h,
                httpx.AsyncClient(base_url=other) as o,
            ):
                await fault(h, kind="pause")
                await fault(o, kind="pause")
                held = []
                for n in (1, 2):  # one on each replica (the loaded one costs more)
                    words = " ".join([f"held number {n} waiting"] * 60)
                    held.append(_send(gw, _body(words)))
                    await _in_flight(gw, n)
                assert _flights(gw) == [1, 1]
                turn = _send(gw, _body(history + " and one more question"), **s)
                await _queued(gw, 1)
                newcomer = _send(gw, _body("a short new conversation"))
                await _queued(gw, 2)
                await fault(o, kind="clear")  # the other replica frees up first
                done, _ = await asyncio.wait({newcomer, turn}, return_when=FIRST_COMPLETED)
                assert done == {newcomer}  # it went before the turn, cheaper there
                assert newcomer.result().headers["x-kvgate-worker"] == other
                await fault(h, kind="clear")
                assert (await turn).status_code == 200
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


async def test_dispatch_keeps_a_request_off_a_free_worker_without_kv_room() -> None:
    """A queued request is not sent to the worker that frees up when it lacks KV room there
    while the other has room: it waits (holding the worker it waits for), and goes to the
    worker with room once that one admits it, not where it would wait for a decode to end."""
    any_prefill = {"max_pending_prefill_tokens": 1}  # any prefill: busy
    async with _small_caches({"max_wait_s": 300}, scheduling=any_prefill) as (gw, urls):
        clients = [httpx.AsyncClient(base_url=u) for u in urls]
        try:
            for client in clients:
                await fault(client, kind="pause")
            long = " ".join(["a long first prompt"] * 50)  # 50 of the 64 blocks
            big = _send(gw, _body(long, max_tokens=8, stream=True))  # its first token seen
            await _in_flight(gw, 1)
            home = next(i for i, n in enumerate(_flights(gw)) if n == 1)
            small = _send(gw, _body("a short one"))
            await _in_flight(gw, 2)
            assert _flights(gw) == [1, 1]
            mid = _send(gw, _body(" ".join(["a request of some twenty blocks"] * 14)))  # 21
            await _queued(gw, 1)
            # the big request's replica runs again, slowly (0.3 s a step): its prefill
            # ends, so it is free for the queue, but it holds its blocks while it decodes
            await fault(clients[home], kind="slow", factor=5e4)
            await fault(clients[home], kind="clear", fault="pause")
            await wait_until(lambda: bool(_queue(gw).holds()), what="a dispatch pass held")
            assert len(_queue(gw)) == 1  # not sent where it lacks room
            other = 1 - home
            assert _flights(gw)[home] == 1
            for client in clients:
                await fault(client, kind="clear")
            reply = await mid
            assert reply.status_code == 200
            assert reply.headers["x-kvgate-worker"] == urls[other]
            assert [r.status_code for r in await asyncio.gather(big, small)] == [200, 200]
        finally:
            for client in clients:
                await client.aclose()


async def test_a_request_that_fits_in_no_kv_cache_waits_for_the_first_with_room() -> None:
    """The ``kv_room`` part: each replica's cache is claimed by its request in flight, so the
    next request (which needs 21 of the 64 blocks) is queued though no other limit is
    reached (a short one would fit: only the worker the queued request holds is busy for it,
    ``room_hold``), and the queued request goes to the replica whose request ends first."""
    async with _small_caches({"max_wait_s": 300}, scheduling=ROOM_ONLY) as (gw, urls):
        async with _paused(urls[0]):
            async with _paused(urls[1]):
                held = await _hold_each(gw, 33)  # 50 of the 64 blocks each
                words = " ".join(["a request of some twenty blocks"] * 14)
                queued = _send(gw, _body(words))
                await _queued(gw, 1)
                explained = await gw.client.post("/debug/route", json=_body(words))
                admission = explained.json()["admission"]
                assert set(admission["busy_workers"]) == set(urls)
                assert sorted(admission["busy_workers"].values()) == [
                    "held for a queued request waiting for KV room there",  # by the queued one
                    "lacks KV room for this request",
                ]
                short = await gw.client.post("/debug/route", json=_body("a short one"))
                assert list(short.json()["admission"]["busy_workers"].values()) == [
                    "held for a queued request waiting for KV room there"
                ]  # the other worker has room for it
            reply = await queued  # the second replica runs again, the first is paused
            assert reply.status_code == 200
            assert reply.headers["x-kvgate-worker"] == urls[1]
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


async def _cached_on(gw: Kvgate, prompt: str, worker: str) -> None:
    """Until kvgate's index holds a prefix of ``prompt`` on ``worker`` (its KV events)."""

    async def overlap() -> int:
        explained = (await gw.client.post("/debug/route", json=_body(prompt))).json()
        return sum(
            w.get("overlap_tokens", 0) for w in explained["workers"] if w["worker"] == worker
        )

    for _ in range(400):
        if await overlap() > 0:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{worker} never held a prefix of the prompt in the index")


@pytest.mark.parametrize("hold", [True, False])
async def test_a_request_waiting_for_kv_room_holds_its_worker_against_smaller_ones(
    hold: bool,
) -> None:
    """The ``room_hold`` part: a turn that fits in no cache waits for room on its first
    choice, the replica holding its prefix; a short request queued behind it, which would go
    there too (its prefix is cached there), is sent to the other replica instead of taking
    the room the turn waits for. With the part off it goes to the turn's replica."""
    tuning = Tuning(parts=replace(KV_FIT, room_hold=hold))
    prefix = "an opening shared by both requests here"
    async with _small_caches({"max_wait_s": 300}, scheduling=ROOM_ONLY, tuning=tuning) as (
        gw,
        urls,
    ):
        home = (await gw.client.post("/v1/completions", json=_body(prefix))).headers[
            "x-kvgate-worker"
        ]
        other = next(u for u in urls if u != home)
        big = prefix + " " + " ".join(["a request of some twenty blocks"] * 14)
        short = prefix + " and a question"
        await _cached_on(gw, short, home)
        async with _paused(urls[0]), _paused(urls[1]):
            held = await _hold_each(gw, 33)  # 50 of the 64 blocks each
            waiting = _send(gw, _body(big))
            await _queued(gw, 1)
            ranked = (await gw.client.post("/debug/route", json=_body(big))).json()["ranked"]
            assert ranked[0] == home  # where its prefix is: the worker it holds
            small = _send(gw, _body(short))
            await _in_flight(gw, 3)  # the short one was sent; the turn still waits
            assert len(_queue(gw)) == 1
            explained = (await gw.client.post("/debug/route", json=_body(short))).json()
            busy = explained["admission"]["busy_workers"]
            in_flight = _flights_by_url(gw)
            if hold:
                assert in_flight == {home: 1, other: 2}
                assert busy[home] == "held for a queued request waiting for KV room there"
            else:
                assert in_flight == {home: 2, other: 1}
        replies = await asyncio.gather(waiting, small, *held)
        assert [r.status_code for r in replies] == [200] * 4


async def test_requests_waiting_for_kv_room_hold_one_worker() -> None:
    """With each of three replicas' caches claimed by its request in flight, the first
    request waiting for room holds one worker (never every worker); a short request queued
    behind them goes to a worker none holds."""
    held = 1
    words = " ".join(["a request of some twenty blocks"] * 14)
    async with _small_caches({"max_wait_s": 300}, replicas=3, scheduling=ROOM_ONLY) as (gw, urls):
        async with contextlib.AsyncExitStack() as paused:
            for url in urls:
                await paused.enter_async_context(_paused(url))
            waiting = await _hold_each(gw, 33)  # 50 of the 64 blocks each
            for n in range(3):
                waiting.append(_send(gw, _body(f"waiting number {n} {words}")))
            await _queued(gw, 3)
            explained = (await gw.client.post("/debug/route", json=_body("short"))).json()
            busy = explained["admission"]["busy_workers"]
            assert (
                list(busy.values())
                == ["held for a queued request waiting for KV room there"] * held
            )
            waiting.append(_send(gw, _body("short")))
            await _in_flight(gw, 4)  # the short one was sent; the three still wait
            assert len(_queue(gw)) == 3
            sent = [url for url, n in _flights_by_url(gw).items() if n == 2]
            assert len(sent) == 1 and sent[0] not in busy
        replies = await asyncio.gather(*waiting)
        assert [r.status_code for r in replies] == [200] * 7


async def test_a_request_waits_for_kv_room_only_part_of_its_wait_limit() -> None:
    """The room patience (a tenth of its wait limit): past it, a request that still fits
    nowhere stops waiting in kvgate and goes as the policy ranked it, to wait in that
    engine's queue, well before its deadline (smaller requests could otherwise keep taking
    the room it waits for)."""
    async with _small_caches({"max_wait_s": 2}, scheduling=ROOM_ONLY) as (gw, urls):
        async with _paused(urls[0]), _paused(urls[1]):
            held = await _hold_each(gw, 33)  # 50 of the 64 blocks each
            words = " ".join(["a request of some twenty blocks"] * 14)
            explained = await gw.client.post("/debug/route", json=_body(words))
            assert explained.json()["admission"]["would_queue"]
            queued = _send(gw, _body(words))
            await _in_flight(gw, 3)  # dispatched after 0.2 s, both replicas still paused
            assert len(_queue(gw)) == 0
            assert sorted(_flights(gw)) == [1, 2]
            metrics = (await gw.client.get("/metrics")).text
            entered = [
                ln for ln in metrics.splitlines() if ln.startswith("kvgate_queue_entered_total")
            ]
            assert [ln.rsplit(" ", 1)[1] for ln in entered] == ["1.0"]  # it was queued first
        reply = await queued
        assert reply.status_code == 200
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


async def test_a_key_filling_the_queue_gives_way_to_another_key() -> None:
    """Shares are on by default: key one alone fills the whole queue (then 429), yet key
    two's requests are still queued, each taking the place of key one's newest until both
    hold as many (before: key two got 429 at once)."""
    async with _setup({"max_length": 4}, scheduling=ONE_AT_A_TIME, api_keys=KEYS) as (gw, url):
        one = {"authorization": f"Bearer {KEYS[0]}"}
        two = {"authorization": f"Bearer {KEYS[1]}"}
        async with _paused(url):
            held = _send(gw, _body("one held"), **one)
            await _in_flight(gw, 1)
            burst = [_send(gw, _body(f"one {i}"), **one) for i in range(4)]
            await _queued(gw, 4)
            alone = await gw.client.post("/v1/completions", json=_body("one more"), headers=one)
            assert alone.status_code == 429 and _error(alone)["code"] == "queue_full"
            others = []
            for i in range(2):
                others.append(_send(gw, _body(f"two {i}"), **two))
                await wait_until(lambda i=i: _queue(gw)._counts.queued_key[TWO] == i + 1)
            refused = await gw.client.post("/v1/completions", json=_body("two more"), headers=two)
            assert refused.status_code == 429 and _error(refused)["code"] == "queue_full"
            assert len(_queue(gw)) == 4
        replies = await asyncio.gather(held, *burst, *others)
        codes = [r.status_code for r in replies]
        assert codes == [200, 200, 200, 429, 429, 200, 200]  # key one's two newest gave way
        assert {_error(r)["code"] for r in replies if r.status_code == 429} == {"queue_share"}
        assert gw.metric("kvgate_queue_rejected_total", {"key": ONE, "reason": "key_share"}) == 2


async def test_queued_bodies_are_bounded_in_bytes() -> None:
    """Past ``queue.max_bytes`` of queued bodies a request gets 429 like a full queue (before:
    only the count bounded them, 1,024 x 32 MiB); a lighter key still gets its place, and the
    queued bytes are on /metrics."""
    pad = "x" * 1000
    queue = {"max_bytes": 2500}
    async with _setup(queue, scheduling=ONE_AT_A_TIME, api_keys=KEYS) as (gw, url):
        one = {"authorization": f"Bearer {KEYS[0]}"}
        two = {"authorization": f"Bearer {KEYS[1]}"}
        async with _paused(url):
            held = _send(gw, _body("held"), **one)
            await _in_flight(gw, 1)
            queued = [_send(gw, _body(f"one {i} {pad}"), **one) for i in range(2)]
            await _queued(gw, 2)
            assert 2000 < _queue(gw).queued_bytes <= 2500
            metrics = (await gw.client.get("/metrics")).text
            assert f"kvgate_queue_bytes {float(_queue(gw).queued_bytes)}" in metrics
            full = await gw.client.post("/v1/completions", json=_body(f"3 {pad}"), headers=one)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert _error(full)["code"] == "queue_bytes_full"
            huge = _body("x" * 3000)
            alone = await gw.client.post("/v1/completions", json=huge, headers=two)
            assert alone.status_code == 429 and _error(alone)["code"] == "queue_bytes_full"
            other = _send(gw, _body(f"two {pad}"), **two)
            await wait_until(lambda: _queue(gw)._counts.queued_key[TWO] == 1, what="key two in")
        replies = await asyncio.gather(held, *queued, other)
        assert [r.status_code for r in replies] == [200, 200, 429, 200]
        assert gw.metric("kvgate_queue_rejected_total", {"key": ONE, "reason": "key_share"}) == 1
        labels = {"key": ONE, "reason": "queue_bytes_full"}
        assert gw.metric("kvgate_queue_rejected_total", labels) == 1
        assert _queue(gw).queued_bytes == 0
