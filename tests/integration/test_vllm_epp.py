"""kvgate as the endpoint picker of a real Envoy in front of the two real vLLM replicas.

``kvgate epp`` (its own process) answers Envoy's ext_proc streams (deploy/envoy/envoy.yaml,
its addresses rewritten by bench/envoy.py); Envoy carries every byte. Multi-turn sessions
(chat and completions, streamed and not) must keep their replica after the first turn, and
kvgate's ``x-kvgate-predicted-cached-tokens`` must equal vLLM's reported cached tokens.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_helpers import MODEL, ChatSession, sse_chunks, stream_result, usage_of

from kvgate.backends.process import ChildProcess, PortAllocator, wait_until
from kvgate.backends.vllm_cpu.launch import Fleet
from kvgate.backends.vllm_cpu.layout import EngineLayout
from kvgate.bench.envoy import Envoy, bootstrap
from kvgate.router.epp.wire import endpoint_of

pytestmark = pytest.mark.vllm

READY_TIMEOUT_S = 90.0
TURNS = 4
SESSIONS = (("chat", False), ("chat", True), ("completion", False), ("completion", True))
MIN_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def epp_behind_envoy(
    vllm_fleet: Fleet, tiny_model_dir: Path, engine_layout: EngineLayout, ports: PortAllocator
) -> Iterator[tuple[str, str]]:
    """(Envoy's URL, kvgate epp's HTTP URL)."""
    http, grpc_port = ports.one(), ports.one()
    logs = engine_layout.logs / "pytest"
    argv = [
        sys.executable, "-m", "kvgate.router.cli", "epp", "--host", "127.0.0.1",
        "--port", str(http), "--grpc-port", str(grpc_port), "--policy", "kv",
        "--tokenizer", str(tiny_model_dir), "--index-block-size", "32",
        "--health-interval-s", "0.5", "--log-level", "debug",
        "--answer-sample", "3",  # a third of the answers read: both kinds run
        *(arg for spec in vllm_fleet.worker_flags() for arg in ("--worker", spec)),
    ]  # fmt: skip
    epp = ChildProcess(argv, name="kvgate epp", log_path=logs / "kvgate-epp.log").start()
    envoy = None
    try:
        url = f"http://127.0.0.1:{http}"

        def ready() -> bool:
            try:
                return bool(httpx.get(f"{url}/ready").json().get("ready_workers") == 2)
            except (httpx.HTTPError, ValueError):
                return False

        wait_until(ready, READY_TIMEOUT_S, "kvgate epp ready with both replicas", watch=[epp])
        workers = [spec.split(",", 1)[0] for spec in vllm_fleet.worker_flags()]
        config = bootstrap(
            listen_port=ports.one(),
            admin_port=ports.one(),
            epp=[f"127.0.0.1:{grpc_port}"],
            pool=[endpoint_of(w) for w in workers],
        )
        envoy = Envoy(config, logs, name="envoy-vllm").start()
        yield envoy.url, url
    finally:
        if envoy is not None:
            envoy.stop()
        epp.stop()


def _body(kind: str, session: ChatSession, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
    if kind == "chat":
        body["messages"] = session.messages
    else:
        body["prompt"] = session.as_prompt()
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _indexed(client: httpx.Client, epp_url: str, body: dict[str, Any], worker: str) -> None:
    """kvgate's index holds the previous turn's blocks on ``worker`` (its events applied)."""

    def overlap() -> bool:
        explained = client.post(f"{epp_url}/debug/route", json=body).json()
        entry = next(w for w in explained["workers"] if w["worker"] == worker)
        return int(entry.get("overlap_tokens", 0)) > 0

    deadline = time.monotonic() + 30
    while not overlap():
        assert time.monotonic() < deadline, "the previous turn's blocks were never indexed"
        time.sleep(0.05)


def test_sessions_through_envoy_keep_their_replica_and_predictions_match_vllm(
    epp_behind_envoy: tuple[str, str], report: Callable[[str], None]
) -> None:
    envoy_url, epp_url = epp_behind_envoy
    sessions = [ChatSession.start(f"epp-{i}", seed=2000 + i) for i in range(len(SESSIONS))]
    homes: dict[str, str] = {}
    checked = agreed = 0
    with httpx.Client(timeout=120.0) as client:
        for turn in range(TURNS):
            for session, (kind, stream) in zip(sessions, SESSIONS, strict=True):
                session.ask()
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                body = _body(kind, session, stream, session.rng.choice((4, 16)))
                if session.name in homes:
                    _indexed(client, epp_url, body, homes[session.name])
                headers = {"x-session-id": session.name}
                if stream:
                    with client.stream(
                        "POST", f"{envoy_url}{path}", json=body, headers=headers
                    ) as reply:
                        assert reply.status_code == 200
                        chunks = sse_chunks(reply.iter_lines())
                        text, _, cached = stream_result(chunks, kind == "chat")
                        worker = reply.headers["x-kvgate-worker"]
                        predicted = int(reply.headers["x-kvgate-predicted-cached-tokens"])
                else:
                    reply = client.post(f"{envoy_url}{path}", json=body, headers=headers)
                    assert reply.status_code == 200, reply.text
                    data = reply.json()
                    choice = data["choices"][0]
                    text = (
                        choice["message"]["content"] if kind == "chat" else choice["text"]
                    ) or ""
                    _, cached = usage_of(data)
                    worker = reply.headers["x-kvgate-worker"]
                    predicted = int(reply.headers["x-kvgate-predicted-cached-tokens"])
                session.answer(text)
                if turn > 0:
                    assert worker == homes[session.name], f"{session.name} moved at turn {turn}"
                homes.setdefault(session.name, worker)
                checked += 1
                agreed += predicted == cached
        metrics = client.get(f"{epp_url}/metrics").text
    totals = {"predicted": 0.0, "engine": 0.0}
    for line in metrics.splitlines():
        if line.startswith("kvgate_predicted_cached_tokens_total{"):
            totals["predicted"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvgate_engine_cached_tokens_total{"):
            totals["engine"] += float(line.rsplit(" ", 1)[1])
    report(
        f"epp behind Envoy: {agreed}/{checked} answers predicted exactly; "
        f"cached tokens predicted {totals['predicted']:.0f}, vLLM {totals['engine']:.0f}"
    )
    assert agreed >= MIN_AGREEMENT * checked
    assert totals["engine"] > 0
    assert abs(totals["predicted"] - totals["engine"]) <= (1 - MIN_AGREEMENT) * totals["engine"]
