"""Issue 7 test 3: a replica restarted mid-run.

kvgate forgets what it knew of the restarted replica (no phantom hits), keeps serving through
the other one meanwhile, and rebuilds the replica's entries from its new event stream. Runs
last in this folder (file order): it restarts a replica of the shared fleet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
from kvgate_server import KvgateServer, index_stats, matched_blocks, route_explain
from vllm_helpers import BLOCK, MODEL, ChatSession, usage_of

from kvgate.backends.process import wait_until
from kvgate.backends.vllm_cpu.launch import EngineStartError, Fleet

pytestmark = pytest.mark.vllm

RESTART_TIMEOUT_S = 420.0
MAX_REQUESTS_DURING_RESTART = 60


def _turn(client: httpx.Client, session: ChatSession) -> tuple[str, int, int, int]:
    """(worker, prompt tokens, predicted, cached) of one turn through kvgate."""
    body = {"model": MODEL, "messages": session.ask(), "max_tokens": 4}
    reply = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session.name})
    reply.raise_for_status()
    data = reply.json()
    session.answer(data["choices"][0]["message"]["content"] or "")
    prompt_tokens, cached = usage_of(data)
    predicted = int(reply.headers["x-kvgate-predicted-cached-tokens"])
    return reply.headers["x-kvgate-worker"], prompt_tokens, predicted, cached


def _healthy(client: httpx.Client, url: str) -> bool:
    workers = client.get("/admin/workers").json()["workers"]
    return any(w["url"] == url and w["healthy"] for w in workers)


def _entries(client: httpx.Client, url: str) -> int:
    """(block, cache domain) entries kvgate's event index holds for a worker."""
    domains = client.get("/debug/index").json()["domains"]
    return sum(d["entries"] for d in domains if d["worker"] == url)


def _subscribed(client: httpx.Client, url: str) -> bool:
    subscribers = client.get("/debug/index").json()["workers"][url]["subscribers"]
    return all(s["connected"] for s in subscribers)


def test_restarted_replica_is_forgotten_bypassed_and_relearned(
    kvgate: KvgateServer, vllm_fleet: Fleet, report: Callable[[str], None]
) -> None:
    session = ChatSession.start("restart-old", seed=6001)
    with httpx.Client(base_url=kvgate.url, timeout=120.0) as client:
        home = _turn(client, session)[0]

        def wait_indexed() -> None:
            """Events reach kvgate asynchronously, shortly after the answer: wait for them
            before the next turn (one sent at once could be routed before they arrive)."""
            user = {"role": "user", "content": "?"}
            probe = {"model": MODEL, "messages": [*session.messages, user]}
            wait_until(
                lambda: matched_blocks(route_explain(client, probe), home) > 0,
                10.0,
                f"kvgate to index the session's blocks on {home}: {index_stats(client)}",
            )

        wait_indexed()
        assert _turn(client, session)[0] == home
        index = vllm_fleet.urls.index(home)
        (other,) = set(vllm_fleet.urls) - {home}
        wait_indexed()
        assert _entries(client, home) > 0

        failures: list[BaseException] = []

        def restart() -> None:
            try:
                vllm_fleet.restart(index, ready_timeout=RESTART_TIMEOUT_S)
            except EngineStartError as exc:
                failures.append(exc)

        restarter = threading.Thread(target=restart, name="restart-replica")
        restarter.start()
        served_while_down: list[str] = []
        try:
            wait_until(lambda: not _healthy(client, home), 60.0, f"kvgate to mark {home} down")
            # Forgotten: kvgate's index holds nothing of the restarted replica any more.
            wait_until(lambda: _entries(client, home) == 0, 10.0, "kvgate to clear the replica")
            while restarter.is_alive() and len(served_while_down) < MAX_REQUESTS_DURING_RESTART:
                # short sessions of 3 turns each, so no prompt outgrows the context
                count = len(served_while_down)
                if count % 3 == 0:
                    bystander = ChatSession.start(f"restart-bystander-{count}", seed=6100 + count)
                worker = _turn(client, bystander)[0]
                if _healthy(client, home):
                    # kvgate saw the replica back (its health probe can beat the restarter's
                    # own readiness wait): from here a turn may rightly go there
                    break
                served_while_down.append(worker)
                restarter.join(timeout=2.0)
        finally:
            restarter.join(timeout=RESTART_TIMEOUT_S)
        assert not failures, failures
        assert not restarter.is_alive()
        assert served_while_down and set(served_while_down) == {other}, served_while_down
        report(f"restart: {len(served_while_down)} requests served by {other} meanwhile")

        wait_until(lambda: _healthy(client, home), 60.0, f"kvgate to mark {home} healthy again")
        wait_until(lambda: _subscribed(client, home), 30.0, "kvgate to re-subscribe")
        # Relearned: a prompt served by the new engine is indexed from its new events...
        fresh = ChatSession.start("restart-new", seed=6003)
        body = {"model": MODEL, "messages": fresh.ask(100), "max_tokens": 1}
        direct = httpx.post(f"{home}/v1/chat/completions", json=body, timeout=60.0)
        direct.raise_for_status()
        blocks = usage_of(direct.json())[0] // BLOCK
        wait_until(
            lambda: matched_blocks(route_explain(client, body), home) == blocks,
            10.0,
            "kvgate to index the restarted replica's new events",
        )
        fresh.answer(direct.json()["choices"][0]["message"]["content"] or "")
        # ...and routed to it with an exact prediction; the old session sees no phantom hit.
        worker, _, predicted, cached = _turn(client, fresh)
        assert (worker, predicted) == (home, cached)
        assert cached > 0
        _, _, predicted, cached = _turn(client, session)
        assert predicted == cached
