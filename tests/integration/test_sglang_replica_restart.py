"""A real SGLang replica restarted under kvgate at its defaults (issue 50, part 1).

kvgate says why the replica is not healthy (log and ``/ready``, no address there), forgets its
blocks (no phantom hits), serves through the other replica meanwhile, and relearns the new
engine's blocks from its events: predictions stay equal to what SGLang reports. Runs after the
other SGLang tests (file order): it restarts a replica of the shared fleet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest
from kvgate_server import KvgateServer
from sglang_helpers import entries, turn, wait_indexed, worker_view
from vllm_helpers import MODEL, ChatSession

from kvgate.backends.process import wait_until
from kvgate.backends.sglang_cpu.launch import SglangFleet, SglangStartError

pytestmark = pytest.mark.sglang

RESTART_TIMEOUT_S = 420.0
MAX_REQUESTS_DURING_RESTART = 40


def _healthy(client: httpx.Client, url: str) -> bool:
    return bool(worker_view(client, url)["healthy"])


def _subscribed(client: httpx.Client, url: str) -> bool:
    subscribers = client.get("/debug/index").json()["workers"][url]["subscribers"]
    return bool(subscribers) and all(s["connected"] for s in subscribers)


def test_a_restarted_sglang_replica_is_explained_forgotten_and_relearned(
    sglang_kvgate: KvgateServer, sglang_fleet: SglangFleet, report: Callable[[str], None]
) -> None:
    session = ChatSession.start("sgl-restart-old", seed=7300)
    with httpx.Client(base_url=sglang_kvgate.url, timeout=120.0) as client:
        home = turn(client, session, 0).worker
        wait_indexed(client, session, home)
        assert entries(client, home) > 0
        position = [w["url"] for w in client.get("/admin/workers").json()["workers"]].index(home)
        (other,) = set(sglang_fleet.urls) - {home}

        failures: list[BaseException] = []

        def restart() -> None:
            try:
                index = sglang_fleet.urls.index(home)
                sglang_fleet.restart(index, ready_timeout=RESTART_TIMEOUT_S)
            except SglangStartError as exc:
                failures.append(exc)

        restarter = threading.Thread(target=restart, name="restart-sglang-replica")
        restarter.start()
        served_while_down: list[str] = []
        try:
            wait_until(lambda: not _healthy(client, home), 60.0, f"kvgate to mark {home} down")
            reason = client.get("/ready").json()["unhealthy"][str(position)]
            assert reason.startswith("health probe: ") and "127.0.0.1" not in reason
            wait_until(lambda: entries(client, home) == 0, 15.0, "kvgate to forget the replica")
            count = 0
            while restarter.is_alive() and count < MAX_REQUESTS_DURING_RESTART:
                if count % 3 == 0:  # short sessions: no prompt outgrows the context
                    bystander = ChatSession.start(f"sgl-bystander-{count}", seed=7400 + count)
                served = turn(client, bystander, count % 3)
                count += 1
                if _healthy(client, home):
                    break  # back: from here a turn may rightly go there
                served_while_down.append(served.worker)
                assert served.predicted == served.cached, served.describe()
                restarter.join(timeout=2.0)
        finally:
            restarter.join(timeout=RESTART_TIMEOUT_S)
        assert not failures, failures
        assert served_while_down and set(served_while_down) == {other}, served_while_down
        log = sglang_kvgate.log_path.read_text(errors="replace")
        assert f"{home} is not healthy: health probe: " in log
        wait_until(lambda: _healthy(client, home), 60.0, f"kvgate to mark {home} healthy again")
        wait_until(lambda: _subscribed(client, home), 30.0, "kvgate to subscribe again")
        report(
            f"SGLang restart: {len(served_while_down)} requests served by the other replica "
            f"meanwhile; reason shown: {reason!r}"
        )
        # the old session: no phantom hit on the restarted replica, exact wherever it goes
        again = turn(client, session, 1)
        assert again.predicted == again.cached, again.describe()
        # relearned: a prompt the new engine served is indexed from its new events, and its
        # next turn goes there with an exact prediction
        fresh = ChatSession.start("sgl-restart-new", seed=7500)
        body = {"model": MODEL, "messages": fresh.ask(100), "max_tokens": 1}
        direct = httpx.post(f"{home}/v1/chat/completions", json=body, timeout=60.0)
        direct.raise_for_status()
        fresh.answer(direct.json()["choices"][0]["message"]["content"] or "")
        wait_indexed(client, fresh, home)
        relearned = turn(client, fresh, 1)
        assert relearned.worker == home, relearned.describe()
        assert relearned.predicted == relearned.cached > 0, relearned.describe()
