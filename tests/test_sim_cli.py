"""``kvgate sim``: flags map onto the configuration; the process serves and stops cleanly."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import pytest

from kvgate.backends.process import ChildProcess, free_port_range, wait_http
from kvgate.backends.sim.cli import build_parser, config_from_args, main
from kvgate.backends.sim.config import ApiConfig, LoraModule

ROOT = Path(__file__).resolve().parent.parent


def test_flags_map_onto_the_config() -> None:
    args = build_parser().parse_args(
        ["--replicas", "3", "--port", "9101", "--events-port", "6000", "--topic=",
         "--event-encoding", "array", "--capacity-blocks", "500", "--cpu-offload-blocks", "100",
         "--speedup", "20", "--block-size", "32", "--fail-rate", "0.5", "--event-delay-ms", "5",
         "--hash-format", "bytes", "--model", "m"]
    )  # fmt: skip
    config = config_from_args(args)
    config.validate()
    assert (config.replicas, config.port, config.events_port) == (3, 9101, 6000)
    assert [config.http_port(i) for i in range(3)] == [9101, 9102, 9103]
    assert [config.pub_port(i) for i in range(3)] == [6000, 6002, 6004]
    assert [config.replay_port(i) for i in range(3)] == [6001, 6003, 6005]
    assert config.events.topic == "" and config.events.encoding == "array"
    assert config.events.hash_format == "bytes"
    assert config.engine.capacity_blocks == 500 and config.engine.cpu_offload_blocks == 100
    assert config.engine.block_size == 32 and config.engine.model == "m"
    assert config.timing.speedup == 20
    assert config.faults.fail_rate == 0.5 and config.faults.event_delay_s == 0.005
    assert config.host == "127.0.0.1"


def test_lora_stream_open_responses_and_prefill_flags() -> None:
    args = build_parser().parse_args(
        ["--lora", "sql=/adapters/sql", "chat", "--lora", "code", "--stream-open",
         "at_first_token", "--responses-store", "5", "--responses-store-mib", "2",
         "--prefill-slowdown", "8"]
    )  # fmt: skip
    config = config_from_args(args)
    config.validate()
    assert config.engine.lora_modules == (
        LoraModule("sql", "/adapters/sql"), LoraModule("chat", "chat"), LoraModule("code", "code")
    )  # fmt: skip
    assert config.api == ApiConfig("at_first_token", 5, 2 * 2**20)
    assert config.faults.prefill_slowdown == 8
    defaults = config_from_args(build_parser().parse_args([]))
    assert defaults.api == ApiConfig() and defaults.api.stream_open == "at_accept"
    assert defaults.engine.lora_modules == ()


@pytest.mark.parametrize(
    "argv",
    [["--replicas", "0"], ["--speedup", "0"], ["--fail-rate", "2"], ["--port", "70000"],
     ["--lora", "a", "a"], ["--lora", "kvgate-sim"], ["--lora", "=p"], ["--prefill-slowdown", "0"],
     ["--responses-store", "-1"], ["--first-replica", "-1"],
     ["--port", "65535", "--replicas", "1", "--first-replica", "1"]],
)  # fmt: skip
def test_invalid_settings_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "kvgate sim:" in capsys.readouterr().err


def test_kvgate_sim_serves_then_stops_on_sigterm(tmp_path: Path) -> None:
    http = free_port_range(6, start=31000)
    events = http + 2
    log = tmp_path / "sim.log"
    argv = [sys.executable, "-m", "kvgate.router.cli", "sim", "--replicas", "2",
            "--port", str(http), "--events-port", str(events), "--topic="]  # fmt: skip
    sim = ChildProcess(argv, name="kvgate sim", log_path=log, cwd=ROOT, own_group=False).start()
    assert sim.popen is not None
    try:
        health = [f"http://127.0.0.1:{port}/health" for port in (http, http + 1)]
        wait_http(health, 60, sim, poll_s=0.05)
        with httpx.Client(timeout=2) as client:
            sources = client.get(f"http://127.0.0.1:{http + 1}/kv_event_sources").json()
        assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{events + 2}"
        assert sources["0"]["replay_endpoint"] == f"tcp://127.0.0.1:{events + 3}"
        assert sources["0"]["topic"] == ""
    finally:
        sim.popen.send_signal(signal.SIGTERM)
        code = sim.popen.wait(timeout=30)
    printed = log.read_text()
    assert code == 0, printed
    assert "port scheme" in printed
    assert f"replica 1: http://127.0.0.1:{http + 1}" in printed
