"""How the side-by-side benchmarks launch the peer routers (bench/peers.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvgate.bench.fleet import FleetSpec, ManagedProcess, SimFleet, start_fleet
from kvgate.bench.peers import (
    BENCH_DIR as BENCH,
)
from kvgate.bench.peers import (
    PEERS,
    READINESS_PATH,
    SGLANG_ROUTER,
    SMG,
    VLLM_ROUTER,
    installed,
    peer_argv,
    start_peer,
)


def _fleet(tmp_path: Path) -> SimFleet:
    process = ManagedProcess("sim", ["true"], tmp_path / "sim.log")  # never started
    return SimFleet(FleetSpec(replicas=2), http_port=18000, events_port=18100, processes=[process])


@pytest.mark.parametrize("name", sorted(PEERS))
def test_a_peer_runs_as_a_module_of_its_venv_interpreter(name: str, tmp_path: Path) -> None:
    """Not through a console script, whose shebang names the path its venv was built at
    (a venv reused from a moved or deleted checkout would not start)."""
    bin_dir = tmp_path / ".engines" / "peer" / "bin"
    argv = peer_argv(PEERS[name], bin_dir, _fleet(tmp_path), 19000, 19001, "m")
    assert argv[:2] == [str(bin_dir / "python"), "-m"]
    assert argv[2].endswith(".launch_router")
    assert argv[argv.index("--policy") + 1] == PEERS[name].policy
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_vllm_router_kv_aware_reads_every_replica_s_events(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    argv = peer_argv(PEERS["vllm_kv_aware"], tmp_path, fleet, 19000, 19001, "m")
    sources = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--kv-event-source"]
    assert sources == [f"{u}={e}" for u, e in zip(fleet.urls, fleet.event_endpoints, strict=True)]
    assert argv[argv.index("--kv-event-block-size") + 1] == "16"


def test_smg_runs_its_router_module_on_loopback_without_event_flags(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    for name in ("smg_cache_aware", "smg_least_load", "smg_prefix_hash", "smg_power_of_two"):
        spec = PEERS[name]
        argv = peer_argv(spec, tmp_path, fleet, 19000, 19001, "m")
        assert argv[1:3] == ["-m", "smg.launch_router"]
        assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
        urls = argv[argv.index("--worker-urls") + 1 :]
        assert urls == fleet.urls
        assert "--kv-event-source" not in argv and spec.policy == name.removeprefix("smg_")
    # pinned: the package and every dependency of its venv
    assert SMG.installs[0][-1] == "smg==1.13.0"
    pins = (BENCH / "constraints-smg.txt").read_text().splitlines()
    assert all("==" in line for line in pins if line and not line.startswith("#"))


def test_gateways_that_answer_health_early_are_waited_for_on_readiness() -> None:
    """sglang-router and smg answer /health before their workers are registered: a run
    that sent traffic then would see errors that are the peer's start-up, not its routing."""
    assert READINESS_PATH[SGLANG_ROUTER.name] == "/readiness"
    assert READINESS_PATH[SMG.name] == "/readiness"
    assert VLLM_ROUTER.name not in READINESS_PATH  # its /health means it routes


@pytest.mark.skipif(not installed(SMG), reason="smg is not installed (.engines/smg)")
def test_smg_routes_once_start_peer_returns(tmp_path: Path) -> None:
    """A real smg 1.13.0 in front of a real simulated fleet: once ``start_peer`` returns
    (readiness answered), the first request through it is served."""
    fleet = start_fleet(FleetSpec(replicas=2), tmp_path / "sim")
    proc = None
    try:
        proc, url = start_peer(PEERS["smg_cache_aware"], fleet, tmp_path / "smg")
        body = {"model": "kvgate-sim", "prompt": "hello there", "max_tokens": 2}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30.0)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 2
    finally:
        if proc is not None:
            proc.stop()
        fleet.stop()
