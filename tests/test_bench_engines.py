"""Fleets of engines we did not write (bench/engines.py) and their measured TTFT floor
(bench/floor.py). The floor is measured here against a real simulated replica (an engine
like any other to it); real vLLM and Dynamo fleets start in the functional runs of
docs/benchmarks.md, not in ``make test``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.vllm_cpu.layout import EngineLayout
from kvgate.bench import engines, floor
from kvgate.bench.args import compare_parser, fleet_spec, load_requests
from kvgate.bench.fleet import FleetSpec, start_fleet
from kvgate.bench.oracle import oracle
from kvgate.bench.traces import TraceRequest


def test_vllm_replicas_serve_the_bench_model_with_capped_kv(tmp_path: Path) -> None:
    spec = FleetSpec(replicas=2, block_size=32, capacity_blocks=256, engine="vllm")
    opts = engines.vllm_options(spec, EngineLayout(tmp_path), tmp_path / "logs")
    assert opts.served_model_name == "kvgate-sim" and opts.topic == ""
    args = list(opts.extra_args)
    assert args[args.index("--num-gpu-blocks-override") + 1] == "256"
    assert "--enable-scale-out" in args  # vllm-router cache_aware's render calls
    assert opts.max_model_len == engines.VLLM_MAX_MODEL_LEN  # 255 blocks hold 4,096 tokens
    small = FleetSpec(block_size=32, capacity_blocks=128, engine="vllm")
    # vLLM refuses to start when one request of the context cannot fit (4,064 at 128 blocks)
    assert engines.vllm_options(small, EngineLayout(tmp_path), tmp_path).max_model_len == 4064
    with pytest.raises(engines.EngineUnavailable, match="multiple of 32"):
        engines.vllm_options(
            FleetSpec(block_size=16, engine="vllm"), EngineLayout(tmp_path), tmp_path
        )


def test_vllm_not_installed_is_said_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_ENGINES_DIR", str(tmp_path / "none"))
    with pytest.raises(engines.EngineUnavailable, match="not installed"):
        engines.start_bench_fleet(FleetSpec(engine="vllm", block_size=32), tmp_path)


def test_mocker_replicas_publish_vllm_events_on_their_own_ports(tmp_path: Path) -> None:
    spec = FleetSpec(block_size=16, capacity_blocks=8000, speedup=4, engine="dynamo-mocker")
    argv = engines.mocker_argv(
        tmp_path, spec, models=tmp_path / "m", namespace="mock1", events_port=25002,
        replay_port=25003,
    )  # fmt: skip
    assert argv[1:3] == ["-m", "dynamo.mocker"]
    value = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert value["--endpoint"] == "dyn://mock1.backend.generate"
    assert (value["--zmq-kv-events-ports"], value["--zmq-replay-ports"]) == ("25002", "25003")
    assert (value["--block-size"], value["--num-gpu-blocks-override"]) == ("16", "8000")
    assert value["--speedup-ratio"] == "4" and value["--model-name"] == "kvgate-sim"


def test_sglang_not_installed_is_said_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_ENGINES_DIR", str(tmp_path / "none"))
    with pytest.raises(engines.EngineUnavailable, match="SGLang-CPU is not installed"):
        engines.start_bench_fleet(FleetSpec(engine="sglang", block_size=32), tmp_path)


def test_sglang_replicas_page_by_the_block_size_and_hold_the_capacity(tmp_path: Path) -> None:
    spec = FleetSpec(replicas=2, block_size=32, capacity_blocks=128, engine="sglang")
    opts = engines.sglang_options(spec, SglangLayout(tmp_path), tmp_path / "logs")
    assert (opts.page_size, opts.max_total_tokens) == (32, 4096)
    assert opts.served_model_name == "kvgate-sim" and opts.topic == ""
    unbounded = FleetSpec(block_size=32, engine="sglang")
    options = engines.sglang_options(unbounded, SglangLayout(tmp_path), tmp_path)
    assert options.max_total_tokens == engines.SGLANG_TOKENS


def test_engine_and_output_cap_options_reach_the_fleet_and_the_slice() -> None:
    argv = [
        "--trace", "synthetic", "--syn-sessions", "4", "--engine", "vllm", "--block-size", "32",
        "--engine-arg=--max-num-seqs", "--engine-arg=8", "--max-output-tokens", "7",
    ]  # fmt: skip
    args = compare_parser().parse_args(argv)
    spec = fleet_spec(args)
    assert spec.engine == "vllm" and spec.engine_args == ("--max-num-seqs", "8")
    reqs, _block = load_requests(args)
    assert reqs and max(r.output_length for r in reqs) <= 7


def _slice() -> list[TraceRequest]:
    """Two sessions of two turns sharing a first block: the oracle caches some prefixes."""
    return [
        TraceRequest(0, 0.0, 60, 4, (1, 2, 3), "a"),
        TraceRequest(1, 0.1, 60, 4, (1, 7, 8), "b"),
        TraceRequest(2, 0.2, 100, 4, (1, 2, 3, 4, 5), "a"),
    ]


def test_the_floor_is_each_request_alone_on_a_replica(tmp_path: Path) -> None:
    chosen = _slice()
    orc = oracle(chosen, block_tokens=20)
    assert [hit for _p, hit in orc.per_request] == [0, 20, 60]
    fleet = start_fleet(FleetSpec(replicas=1), tmp_path)
    try:
        floors = asyncio.run(floor.measure(fleet.urls[0], chosen, orc, 20, "kvgate-sim"))
    finally:
        fleet.stop()
    assert sorted(floors) == [0, 1, 2] and all(t > 0 for t in floors.values())


def test_a_measured_floor_is_read_back_not_measured_again(tmp_path: Path) -> None:
    chosen = _slice()
    idle = {"0": 0.1, "1": 0.2, "2": 0.3}
    (tmp_path / floor.FLOOR_FILE).write_text(json.dumps({"requests": 3, "ttft_s": idle}))
    spec = FleetSpec(engine="nope")  # would fail to start: proves nothing is started
    got = floor.measured_floor(chosen, oracle(chosen, block_tokens=20), spec, 20, tmp_path, None)
    assert got == {0: 0.1, 1: 0.2, 2: 0.3}


def test_the_floor_is_lowered_to_the_best_any_run_had(tmp_path: Path) -> None:
    """One slow idle sample must not put the floor above what a router achieved: each
    request's floor is the lowest of its idle value and its TTFT in every run."""
    run = tmp_path / "records.jsonl"
    lines = [
        {"index": 0, "status": "ok", "ttft_s": 0.05},
        {"index": 1, "status": "ok", "ttft_s": 0.9},
        {"index": 2, "status": "error", "ttft_s": None},
    ]
    run.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert floor.lowest({0: 0.1, 1: 0.2, 2: 0.3}, [run]) == [0.05, 0.2, 0.3]
