"""Do no harm (``scheduling.guard``): a mechanism whose moves lose more than they gain, on
the engines' measured TTFT, turns itself off on that worker for a while; the price is
audited, never turned off. Pure parts first, then through a real kvgate in front of
simulated replicas (one of them slowed down by a fault)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from fakes.gateway import Kvgate
from fakes.simgate import MODEL, fleet_config, gate, sim_fleets, worker_specs
from fakes.wait import wait_until
from hypothesis import given
from hypothesis import strategies as st
from test_sim_support import fault

from kvgate.index.types import WorkerId
from kvgate.scheduling.capacity import KV_FIT, PartsTable
from kvgate.scheduling.config import Tuning
from kvgate.scheduling.guard import (
    GUARDED,
    PRICE,
    Guard,
    GuardConfig,
    Move,
    moved_part,
    part_of,
    signals,
)

A, B = WorkerId("a"), WorkerId("b")


def _guard(**config: Any) -> Guard:
    return Guard(PartsTable(KV_FIT), GuardConfig(**config))  # every part on


def _settle(guard: Guard, part: str, net_s: float, now: float = 0.0, worker: WorkerId = A) -> Any:
    """A move of ``part`` off ``worker`` whose outcome is ``net_s`` (predicted 1 s there)."""
    move = Move(part, worker, 1.0, 0)
    return guard.settle(move, waited_s=0.0, measured_s=1.0 - net_s, added_prefill_s=0.0, now=now)


def test_a_part_that_loses_is_turned_off_on_that_worker_only() -> None:
    guard = _guard(min_moves=3, cooldown_s=10.0)
    assert not _settle(guard, "waiting", -0.5).turned_off
    assert not _settle(guard, "waiting", -0.5).turned_off
    assert _settle(guard, "waiting", -0.5).turned_off
    assert not guard.parts.of(A).waiting
    assert guard.parts.of(A).kv_room  # the other parts stay
    assert guard.parts.of(B) == KV_FIT  # and the other workers
    assert guard.is_off(A, "waiting")


def test_a_part_that_pays_stays_on() -> None:
    guard = _guard(min_moves=2)
    for net in (0.4, -0.1, 0.3, -0.2, 0.5):
        assert not _settle(guard, "kv_room", net).turned_off
    assert guard.parts.of(A).kv_room


def test_the_price_is_audited_never_turned_off() -> None:
    guard = _guard(min_moves=1)
    settled = _settle(guard, PRICE, -3.0)
    assert settled.net_s == pytest.approx(-3.0)
    assert not settled.turned_off
    assert guard.parts.of(A) == KV_FIT
    assert guard.describe(A, 0.0)[PRICE]["moves"] == 1


def test_a_part_comes_back_after_its_time_off_and_stays_off_longer_next_time() -> None:
    guard = _guard(min_moves=1, cooldown_s=10.0, max_cooldown_s=25.0)
    _settle(guard, "pending_prefill", -1.0, now=0.0)
    assert guard.tick(9.9) == []
    assert guard.tick(10.0) == [(A, "pending_prefill")]
    assert guard.parts.of(A) == KV_FIT  # back to the default: no override kept
    _settle(guard, "pending_prefill", -1.0, now=20.0)  # off again: 20 s this time
    assert guard.tick(39.9) == []
    assert guard.tick(40.0) == [(A, "pending_prefill")]
    _settle(guard, "pending_prefill", -1.0, now=50.0)  # 40 s, capped at 25
    assert guard.tick(75.0) == [(A, "pending_prefill")]


def test_the_window_is_bounded_and_a_departed_worker_is_forgotten() -> None:
    guard = _guard(window=4, min_moves=10)
    for _ in range(100):
        _settle(guard, "in_flight", 1.0)
    assert guard.describe(A, 0.0)["in_flight"]["recent_moves"] == 4
    assert guard.describe(A, 0.0)["in_flight"]["moves"] == 100
    guard.worker_removed(A)
    assert guard.describe(A, 0.0) == {}


def test_a_disabled_guard_audits_but_turns_nothing_off() -> None:
    guard = _guard(enabled=False, min_moves=1)
    assert not _settle(guard, "waiting", -5.0).turned_off
    assert guard.parts.of(A) == KV_FIT


def test_the_net_counts_the_wait_the_ttft_and_the_prefill_given_up() -> None:
    guard = _guard()
    move = Move("kv_room", A, 2.0, 512)
    settled = guard.settle(move, waited_s=0.5, measured_s=0.75, added_prefill_s=0.25, now=0.0)
    assert settled.net_s == pytest.approx(2.0 - 0.5 - 0.75 - 0.25)


def test_which_part_moved_a_request() -> None:
    def code(worker: WorkerId) -> str | None:
        return {A: "waiting"}.get(worker)

    assert moved_part([A, B], B, code, best_matched=A) == ("waiting", A)
    assert moved_part([B, A], B, code, best_matched=A) == (PRICE, A)  # cache passed over
    assert moved_part([B, A], B, code, best_matched=B) is None
    assert moved_part([B, A], B, code, best_matched=None) is None
    assert moved_part([], B, code, best_matched=None) is None
    assert part_of("held") == "room_hold"
    assert set(GUARDED) <= set(KV_FIT.active())


def test_missing_signals_are_named() -> None:
    assert signals(waiting=True, kv_usage=True, kv_capacity=True) == {}
    missing = signals(waiting=False, kv_usage=False, kv_capacity=False)
    assert set(missing) == {"waiting", "kv_usage", "kv_room"}


@given(st.lists(st.tuples(st.sampled_from(GUARDED), st.floats(-10, 10)), max_size=200))
def test_a_part_is_off_exactly_when_its_last_full_window_lost(
    moves: list[tuple[str, float]],
) -> None:
    """Against a reference model: a part goes off when its recent moves (since it last went
    off, at most ``window``) number at least ``min_moves`` and their mean is negative."""
    guard = _guard(window=5, min_moves=3, cooldown_s=1e9)
    recent: dict[str, list[float]] = {part: [] for part in GUARDED}
    off: set[str] = set()
    for part, net in moves:
        settled = _settle(guard, part, net)
        window = (recent[part] + [settled.net_s])[-5:]
        expect_off = len(window) >= 3 and sum(window) / len(window) < 0
        assert settled.turned_off is expect_off
        recent[part] = [] if expect_off else window
        if expect_off:
            off.add(part)
    assert {p for p in GUARDED if not getattr(guard.parts.of(A), p)} == off


# -- through a real kvgate -----------------------------------------------------------------

PREFIX = "the cached part of a long conversation that one replica holds " * 8


def _body(tail: str, *, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PREFIX + tail, "max_tokens": 2, "stream": stream}


async def _stream(client: httpx.AsyncClient, tail: str, timeout_s: float = 10.0) -> str:
    """Send one streamed completion through kvgate; the worker that answered."""
    body = _body(tail)
    async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as reply:
        assert reply.status_code == 200
        async for _ in reply.aiter_bytes():
            pass
        return reply.headers["x-kvgate-worker"]


async def _explain(client: httpx.AsyncClient, tail: str) -> dict[str, Any]:
    reply = await client.post("/debug/route", json=_body(tail, stream=False))
    assert reply.status_code == 200, reply.text
    explained: dict[str, Any] = reply.json()
    return explained


def _chosen(explained: dict[str, Any]) -> str:
    return next(w["worker"] for w in explained["workers"] if w.get("chosen"))


@contextlib.asynccontextmanager
async def _fleet_and_kvgate(guard: GuardConfig) -> AsyncIterator[tuple[Kvgate, list[str]]]:
    """Two simulated replicas, KV events wired, kvgate's kv policy with a limit of one
    request in flight per worker."""
    async with sim_fleets(fleet_config(2)) as (fleet,):
        workers = worker_specs(fleet, models=MODEL)
        tuning = Tuning(guard=guard)
        async with gate(workers, scheduling={"max_in_flight": 1}, tuning=tuning) as gw:
            yield gw, [r.url for r in fleet.replicas]


@pytest.mark.anyio
async def test_a_limit_that_moves_requests_to_a_slow_worker_turns_itself_off() -> None:
    """The holder of a prefix is at its in-flight limit; the limit sends the prefix's next
    requests to the other replica, which is slow: they lose against the holder's predicted
    TTFT, and the limit is then off on the holder (metrics, /debug/route). (One move is
    enough here: after it, the other replica holds the prefix too and ranks first.)"""
    config = GuardConfig(min_moves=1, cooldown_s=600.0)
    async with _fleet_and_kvgate(config) as (gw, urls):
        client = gw.client
        holder = await _stream(client, " warm")  # the prefix is cached there
        other = next(u for u in urls if u != holder)

        async def holder_ranked_first() -> bool:
            return _chosen(await _explain(client, " probe")) == holder

        await wait_until(holder_ranked_first, 10.0, "the prefix indexed on its holder")
        part = {"worker": holder, "part": "in_flight"}
        assert gw.metric("kvgate_mechanism_active", part) == 1
        async with httpx.AsyncClient(base_url=holder) as h, httpx.AsyncClient(base_url=other) as o:
            await fault(o, kind="slow", factor=20000.0)  # a step: ~0.4 s
            await fault(h, kind="pause")
            async with anyio.create_task_group() as tasks:
                held: list[str] = []

                async def send_held() -> None:
                    held.append(await _stream(client, " held", timeout_s=120.0))

                tasks.start_soon(send_held)  # on the holder (its cache); paused there
                await wait_until(lambda: gw.sent(holder).in_flight == 1, 10.0, "held request")
                assert await _stream(client, " one") == other  # moved off by the limit
                turned_off = {"part": "in_flight"}
                await wait_until(
                    lambda: gw.metric("kvgate_mechanism_moves_total", turned_off) == 1,
                    10.0,
                    "the move settled (after the answer's last byte)",
                )
                assert gw.metric("kvgate_mechanism_turned_off_total", turned_off) == 1
                assert gw.metric("kvgate_mechanism_loss_seconds_total", turned_off) > 0
                assert gw.metric("kvgate_mechanism_active", part) == 0
                explained = await _explain(client, " three")
                entry = next(w for w in explained["workers"] if w["worker"] == holder)
                assert gw.sent(holder).in_flight == 1
                assert entry["admitted"]  # one in flight, but the limit no longer refuses it
                guard = explained["guard"][holder]
                assert "in_flight" not in guard["parts_in_force"]
                assert guard["audits"]["in_flight"]["times_turned_off"] == 1
                assert guard["audits"]["in_flight"]["off_for_s"] > 0
                assert "in_flight" in explained["guard"][other]["parts_in_force"]
                await fault(h, kind="clear")
            assert held == [holder]
