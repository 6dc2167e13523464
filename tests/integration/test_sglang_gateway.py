"""kvgate at its defaults in front of two real SGLang 0.5.23 replicas (issue 50, part 1).

No ``--tokenizer``, no block size, the default probe timeout: kvgate marks the replicas
healthy (SGLang's ``/ready``), adopts their page size and KV capacity (``/server_info``),
keys prompts with SGLang's own ``/tokenize``, and predicts exactly what SGLang reports as
cached (``usage.prompt_tokens_details.cached_tokens``): over interleaved multi-turn sessions
(chat and completions, streamed and not), in a kvgate started after them (replay), and across
``POST /flush_cache`` (AllBlocksCleared).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from kvgate_server import KvgateServer
from sglang_helpers import (
    CAPACITY_TOKENS,
    PAGE,
    Turn,
    entries,
    next_chat,
    turn,
    wait_indexed,
    worker_view,
)
from vllm_helpers import MODEL, ChatSession

from kvgate.backends.process import PortAllocator, wait_until
from kvgate.backends.sglang_cpu.launch import SglangFleet
from kvgate.backends.sglang_cpu.layout import SglangLayout

pytestmark = pytest.mark.sglang

TURNS = 5
SESSIONS: tuple[tuple[str, bool], ...] = (
    ("chat", False),
    ("chat", True),
    ("completion", False),
    ("completion", True),
    ("chat", False),
    ("chat", True),
    ("completion", False),
    ("chat", True),
)


def _metric(client: httpx.Client, name: str, labels: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_kvgate_at_defaults_marks_sglang_ready_and_adopts_its_facts(
    sglang_kvgate: KvgateServer, sglang_fleet: SglangFleet
) -> None:
    with httpx.Client(base_url=sglang_kvgate.url, timeout=30.0) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["healthy_workers"] == 2
        assert "unhealthy" not in ready.json()
        blocks = CAPACITY_TOKENS // PAGE
        for url in sglang_fleet.urls:
            wait_until(
                lambda url=url: worker_view(client, url)["scraped"]["kv_capacity_blocks"] == blocks,
                15.0,
                f"a scrape of {url} with its declared KV capacity",
            )
            view = worker_view(client, url)
            assert (view["engine"], view["block_size"], view["problems"]) == ("sglang", PAGE, {})
        stats = client.get("/debug/index").json()
        assert stats["block_sizes"]["declared_by_engines"] == {MODEL: PAGE}
    log = sglang_kvgate.log_path.read_text(errors="replace")
    assert "is not healthy" not in log


def test_predicted_cached_tokens_equal_sglang_reported(
    sglang_kvgate: KvgateServer, report: Callable[[str], None]
) -> None:
    sessions = [ChatSession.start(f"sgl-predict-{i}", seed=7000 + i) for i in range(len(SESSIONS))]
    turns: list[Turn] = []
    with httpx.Client(base_url=sglang_kvgate.url, timeout=120.0) as client:
        for index in range(TURNS):
            for session, (kind, stream) in zip(sessions, SESSIONS, strict=True):
                max_tokens = session.rng.choice((4, 16, 40))
                turns.append(turn(client, session, index, kind, stream, max_tokens))
        engine_keyed = _metric(client, "kvgate_tokenize_total", 'mode="engine"')
        approx = _metric(client, "kvgate_tokenize_total", 'mode="approx"')
    mismatches = [t for t in turns if t.predicted != t.cached]
    hits = sum(t.cached for t in turns) / sum(t.prompt_tokens for t in turns)
    later = [t for t in turns if t.turn > 0]
    later_hits = sum(t.cached for t in later) / sum(t.prompt_tokens for t in later)
    report(
        f"SGLang: predicted == cached on {len(turns) - len(mismatches)} of {len(turns)} "
        f"requests; engine hit rate {hits:.3f} ({later_hits:.3f} after the first turn); "
        f"keyed by SGLang's /tokenize {engine_keyed:.0f}, approximately {approx:.0f}"
    )
    assert not mismatches, json.dumps([t.describe() for t in mismatches], indent=1)
    assert approx == 0 and engine_keyed >= len(turns)
    assert later_hits > 0.5  # sessions went back to their cache


def test_a_kvgate_started_later_replays_what_sglang_holds(
    sglang_kvgate: KvgateServer,
    sglang_fleet: SglangFleet,
    sglang_layout: SglangLayout,
    ports: PortAllocator,
) -> None:
    sessions = [ChatSession.start(f"sgl-replay-{i}", seed=7100 + i) for i in range(4)]
    with httpx.Client(base_url=sglang_kvgate.url, timeout=120.0) as client:
        for session in sessions:
            first = turn(client, session, 0)
            wait_indexed(client, session, first.worker)
    log_path = sglang_layout.logs / "pytest" / "kvgate-sglang-replayed.log"
    flags = sglang_fleet.worker_flags()
    with (
        KvgateServer(flags, None, log_path, ports.one(), block_size=None) as later,
        httpx.Client(base_url=later.url, timeout=120.0) as client,
    ):
        for session in sessions:
            again = turn(client, session, 1)
            assert again.predicted == again.cached > 0, again.describe()


def test_flush_cache_clears_kvgate_and_predictions_stay_exact(
    sglang_kvgate: KvgateServer, sglang_fleet: SglangFleet
) -> None:
    session = ChatSession.start("sgl-flush", seed=7200)
    with httpx.Client(base_url=sglang_kvgate.url, timeout=120.0) as client:
        home = turn(client, session, 0).worker
        wait_indexed(client, session, home)
        held = turn(client, session, 1)
        assert held.worker == home and held.predicted == held.cached > 0
        wait_indexed(client, session, home)
        flushed = httpx.post(f"{home}/flush_cache", timeout=30.0)
        assert flushed.status_code == 200, flushed.text
        wait_until(lambda: entries(client, home) == 0, 15.0, "kvgate to clear the flushed replica")
        explained = client.post("/debug/route", json=next_chat(session)).json()
        assert all(sum(w.get("matched_blocks", {}).values()) == 0 for w in explained["workers"])
        cold = turn(client, session, 2)
        assert cold.predicted == cold.cached == 0, cold.describe()
        wait_indexed(client, session, cold.worker)
        warm = turn(client, session, 3)
        assert warm.predicted == warm.cached > 0, warm.describe()
