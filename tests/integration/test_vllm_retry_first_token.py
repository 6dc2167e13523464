"""Issue 14: a replica killed while a long prompt prefills costs the client nothing.

vLLM answers a streaming request with ``200`` and its SSE headers as soon as it accepts it,
then queues and prefills. kvgate holds that response until the first token: when the engine
is killed (SIGKILL) with the request accepted and not yet answered, kvgate retries it on the
other replica and the client gets one clean stream. The tiny model prefills fast on a quiet
box, so the victim's engine core is frozen (SIGSTOP) mid-prefill of a burst of long prompts
before ours is sent: its API server still accepts ours, and the kill comes before any token
can. Runs last in this folder (file order):
it kills a replica of the shared fleet, and starts it again before it ends.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvgate_server import KvgateServer
from vllm_helpers import MODEL, sentence, sse_chunks, stream_result

from kvgate.backends.process import PortAllocator, wait_until
from kvgate.backends.vllm_cpu.launch import Fleet
from kvgate.backends.vllm_cpu.layout import EngineLayout

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 3600  # of the replicas' max_model_len 4096
BURST = 8  # long prompts sent straight to the victim first, so that ours waits behind them
RESTART_TIMEOUT_S = 420.0


def long_prompt(client: httpx.Client, url: str, seed: int, tokens: int = PROMPT_TOKENS) -> str:
    """Words of the test vocabulary, as many as make about ``tokens`` tokens (``/tokenize``)."""

    def count(text: str) -> int:
        reply = client.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text})
        reply.raise_for_status()
        return int(reply.json()["count"])

    words = tokens
    for _ in range(4):  # scale the word count by the measured tokens per word
        text = f"{seed}: " + sentence(random.Random(seed), words)
        measured = count(text)
        if tokens * 0.9 <= measured <= tokens:
            return text
        words = max(1, int(words * tokens * 0.95 / measured))
    return text


def accepted(log_path: Path) -> int:
    """Streams the replica has answered ``200`` to so far: uvicorn logs a request's access
    line when its response starts, which vLLM does as soon as it accepts a streaming request
    (before queueing and prefill)."""
    text = log_path.read_text(errors="replace")
    return text.count('"POST /v1/completions HTTP/1.1" 200')


def stop_engine_core(leader: int) -> list[int]:
    """SIGSTOP every process of the replica's group but its leader (vLLM's API server): the
    engine core stops where it is, mid-prefill, while the API server still accepts requests
    and answers them ``200`` at once. Deterministic where a race with a fast prefill is not."""
    stopped = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == leader:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == leader:  # its process group
            os.kill(int(entry.name), signal.SIGSTOP)
            stopped.append(int(entry.name))
    return stopped


def _stream_directly(url: str, prompt: str) -> None:
    """A long request held open on the victim (it dies with the engine)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True}
    try:
        with (
            httpx.Client(timeout=300.0) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as reply,
        ):
            for _ in reply.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # killed: expected


def test_a_replica_killed_while_a_long_prompt_prefills_loses_no_request(
    vllm_fleet: Fleet,
    tiny_model_dir: Path,
    engine_layout: EngineLayout,
    ports: PortAllocator,
    report: Callable[[str], None],
) -> None:
    victim, survivor = vllm_fleet.replicas
    log_path = engine_layout.logs / "pytest" / "kvgate-retry.log"
    flags = vllm_fleet.worker_flags()
    # round robin: kvgate's first routed request goes to the first worker, the victim
    extra = ("--policy", "round_robin")
    burst: list[threading.Thread] = []
    try:
        with (
            KvgateServer(flags, tiny_model_dir, log_path, ports.one(), extra) as gw,
            httpx.Client(timeout=60.0) as client,
        ):
            url = victim.spec.url
            # the prompts first (each takes a few /tokenize calls): the burst then arrives at
            # once and queues several seconds of prefill ahead of ours
            prompts = [long_prompt(client, url, seed=14_000 + i) for i in range(BURST)]
            ours = long_prompt(client, url, seed=14_100)
            before = accepted(victim.log_path)
            for prompt in prompts:
                burst.append(threading.Thread(target=_stream_directly, args=(url, prompt)))
                burst[-1].start()
            wait_until(
                lambda: accepted(victim.log_path) >= before + BURST, 60.0, "the burst accepted"
            )
            victim_pid = victim.pid
            assert victim_pid is not None
            assert stop_engine_core(victim_pid)  # frozen mid-prefill of the burst
            result: dict[str, Any] = {}

            def call() -> None:
                body = {
                    "model": MODEL,
                    "prompt": ours,
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                with (
                    httpx.Client(base_url=gw.url, timeout=300.0) as mine,
                    mine.stream("POST", "/v1/completions", json=body) as reply,
                ):
                    result["status"] = reply.status_code
                    result["worker"] = reply.headers.get("x-kvgate-worker")
                    result["lines"] = list(reply.iter_lines())

            caller = threading.Thread(target=call)
            caller.start()
            # ours is accepted by the victim (its 200 and headers sent to kvgate) and waits
            # behind the burst's prefill: kill the engine now
            wait_until(
                lambda: accepted(victim.log_path) >= before + BURST + 1, 60.0, "ours accepted"
            )
            assert caller.is_alive() and not result  # nothing has reached the client
            os.killpg(victim_pid, signal.SIGKILL)
            caller.join(timeout=300.0)
            assert not caller.is_alive()

            assert result["status"] == 200
            assert result["worker"] == survivor.spec.url
            assert not any("error" in line for line in result["lines"]), result["lines"][-3:]
            text, prompt_tokens, _ = stream_result(sse_chunks(result["lines"]), chat=False)
            assert text and prompt_tokens >= PROMPT_TOKENS * 0.9
            assert "data: [DONE]" in result["lines"]
            metrics = client.get(f"{gw.url}/metrics").text
            retried = [
                line
                for line in metrics.splitlines()
                if line.startswith("kvgate_upstream_retries_total{")
                and f'worker="{url}"' in line
                and not line.endswith(" 0.0")
            ]
            assert retried, metrics
            report(f"killed mid-prefill: retried on the survivor ({'; '.join(retried)})")
    finally:
        for thread in burst:
            thread.join(timeout=60.0)
        victim.stop()
        vllm_fleet.restart(0, ready_timeout=RESTART_TIMEOUT_S)
