"""How the side-by-side benchmarks launch the peer routers (bench/peers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fleet import FleetSpec, ManagedProcess, SimFleet
from bench.peers import PEERS, peer_argv


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
