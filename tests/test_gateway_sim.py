"""``kvgate serve --sim``: the simulated fleet subprocess, wired with events and tokenizer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fakes.gateway import kvgate

from kvgate.backends.process import ChildProcess, free_port_range, wait_http, wait_until
from kvgate.router.config import load_settings
from kvgate.router.simfleet import SIM_MODEL, SimFleet

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_sim_fleet_is_routed_cache_aware_and_stopped() -> None:
    base = free_port_range(2, start=31500)
    events = free_port_range(4, start=28500)
    fleet = SimFleet(2, base_port=base, events_port=events)
    with fleet:
        overrides = fleet.settings_overrides({})
        settings = load_settings(None, overrides)
        assert [w.events for w in settings.workers] == [
            f"tcp://127.0.0.1:{events}",
            f"tcp://127.0.0.1:{events + 2}",
        ]
        assert settings.index.tokenizers[SIM_MODEL].is_dir()
        async with kvgate(
            overrides["workers"], policy="kv", tokenizers=overrides["tokenizers"]
        ) as gw:
            words = " ".join(["alpha beta gamma delta"] * 20)
            body = {
                "model": SIM_MODEL,
                "messages": [{"role": "user", "content": words}],
                "max_tokens": 2,
            }
            first = await gw.client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200
            worker = first.headers["x-kvgate-worker"]

            async def predicted() -> int:
                explained = (await gw.client.post("/debug/route", json=body)).json()
                assert explained["tokenize_mode"] == "tokenizer"
                entry = next(w for w in explained["workers"] if w["worker"] == worker)
                return int(entry["overlap_tokens"])

            deadline = time.monotonic() + 10  # the engine's BlockStored events reach the index
            while (overlap := await predicted()) == 0:
                assert time.monotonic() < deadline, "no KV events indexed"
                await asyncio.sleep(0.02)
            assert overlap > 0
            again = await gw.client.post("/v1/chat/completions", json=body)
            assert again.headers["x-kvgate-worker"] == worker
            assert int(again.headers["x-kvgate-predicted-cached-tokens"]) == overlap
        process = fleet._process
        assert process is not None and process.alive()
    assert not process.alive()  # the fleet stopped with the block


async def test_streamed_requests_calibrate_each_replicas_ttft_model() -> None:
    """Every answered streamed request through kvgate to a simulated replica is one
    observation: /debug/route shows each replica's predicted TTFT and its parts (shown, the
    cost in blocks decides), /metrics the prediction error and the learned model per
    replica."""
    base = free_port_range(2, start=29500)
    events = free_port_range(4, start=30500)
    with SimFleet(2, base_port=base, events_port=events) as fleet:
        overrides = fleet.settings_overrides({})
        async with kvgate(
            overrides["workers"],
            policy="kv",
            tokenizers=overrides["tokenizers"],
        ) as gw:
            served: dict[str, int] = {}
            for i in range(12):
                words = " ".join(f"w{i}x{j}" for j in range(50 * (i + 1)))
                body = {"model": SIM_MODEL, "prompt": words, "max_tokens": 2, "stream": True}
                async with gw.client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    await r.aread()
                    worker = r.headers["x-kvgate-worker"]
                served[worker] = served.get(worker, 0) + 1
            explained = (await gw.client.post("/debug/route", json=body)).json()
            assert len(explained["workers"]) == 2
            for entry in explained["workers"]:
                terms = entry["terms"]
                assert entry["predicted_ttft_s"] == terms["ttft_s"] > 0
                parts = ("ttft_base_s", "ttft_queue_s", "ttft_prefill_s", "ttft_interference_s")
                assert terms["ttft_s"] == pytest.approx(sum(terms[p] for p in parts))
                assert terms["prefill_tokens_per_s"] > 0 and terms["model_observations"] >= 0
                assert entry["cost"] == terms["cost"]
                assert "queued_prefill_blocks" in terms  # blocks decide; the TTFT is shown
            learned = {e["worker"]: e["terms"]["model_observations"] for e in explained["workers"]}
            for worker, count in served.items():
                assert learned[worker] > 0  # the model learned from the requests it served
                labels = {"worker": worker}
                assert gw.metric("kvgate_ttft_prediction_error_seconds_count", labels) == count
                assert gw.metric("kvgate_ttft_model_prefill_tokens_per_second", labels) > 0
                assert gw.metric("kvgate_ttft_prediction_mean_abs_error_seconds", labels) >= 0


ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextmanager
def _serve_sim(log: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``kvgate serve --sim 2`` on free ports, ready; yields it and its simulator's pid."""
    port = free_port_range(1, start=26500)
    base, events = free_port_range(2, start=27000), free_port_range(4, start=27500)
    argv = [sys.executable, "-m", "kvgate.router.cli", "serve", "--sim", "2", "--port", str(port),
            "--sim-port", str(base), "--sim-events-port", str(events)]  # fmt: skip
    serve = ChildProcess(argv, name="kvgate serve --sim", log_path=log, cwd=ROOT, own_group=False)
    proc = serve.start().popen
    assert proc is not None
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", 90, serve, poll_s=0.05)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children  # the kvgate sim subprocess
        yield proc, int(children[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_stops_the_simulated_replicas_too(tmp_path: Path) -> None:
    with _serve_sim(tmp_path / "serve.log") as (proc, sim):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
        assert not _alive(sim)  # stopped and reaped before kvgate serve exited


def test_simulated_replicas_exit_when_serve_is_killed_outright(tmp_path: Path) -> None:
    with _serve_sim(tmp_path / "serve.log") as (proc, sim):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not _alive(sim), 30, "the simulator to exit with kvgate serve")
