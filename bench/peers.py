"""Peer routers for side-by-side runs, each in its own venv under ``.engines/`` and bound to
127.0.0.1 (serving and Prometheus ports alike): sglang-router 0.3.2, vllm-router 0.1.17 and
smg 1.13.0 (the SGLang model gateway, sglang-router's successor), one process each; and
NVIDIA Dynamo's KV router (a frontend and one relay worker per replica: bench/dynamo_peer.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvgate.backends.process import LOOPBACK
from kvgate.backends.vllm_cpu.layout import EngineLayout
from kvgate.bench.fleet import (
    BenchFleet,
    ManagedProcess,
    bench_port_range,
    pd_roles,
    port_of,
    wait_own_http,
)

ENGINES_DIR = EngineLayout.default().root  # beside the engines (KVGATE_ENGINES_DIR)
BENCH_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class PeerPackage:
    name: str  # venv folder under .engines/
    installs: tuple[tuple[str, ...], ...]
    """``pip install`` arguments, one tuple per call, in order (every version pinned)."""
    module: str  # its entry point, run as ``python -m <module>``

    def launch(self, bin_dir: Path) -> list[str]:
        """The command that starts it: its venv's interpreter running the module, not a
        console script, whose shebang names the path the venv was built at (a venv reused
        from a moved checkout would fail to start it)."""
        return [str(bin_dir / "python"), "-m", self.module]


SGLANG_ROUTER = PeerPackage(
    "sglang-router", (("sglang-router==0.3.2",),), "sglang_router.launch_router"
)
VLLM_ROUTER = PeerPackage("vllm-router", (("vllm-router==0.1.17",),), "vllm_router.launch_router")
SMG = PeerPackage(
    "smg", (("-c", str(BENCH_DIR / "constraints-smg.txt"), "smg==1.13.0"),), "smg.launch_router"
)


def venv_python(pkg: PeerPackage) -> Path:
    return ENGINES_DIR / pkg.name / "bin" / "python"


def installed(pkg: PeerPackage) -> bool:
    """Whether ``ensure_installed`` finished for ``pkg`` (its marker is there)."""
    return (venv_python(pkg).parent.parent / ".installed").is_file()


def ensure_installed(pkg: PeerPackage, log_dir: Path) -> Path:
    """Create ``.engines/<name>`` and pip-install the pinned peer once; return its bin dir."""
    python = venv_python(pkg)
    marker = python.parent.parent / ".installed"
    if marker.exists():
        return python.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"install-{pkg.name}.log"
    with log.open("wb") as fh:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(python.parent.parent)],
                check=True,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        for args in pkg.installs:
            subprocess.run(
                [str(python), "-m", "pip", "install", "--quiet", *args],
                check=True,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
    marker.write_text(json.dumps([list(a) for a in pkg.installs]) + "\n")
    return python.parent


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One single-process peer router configuration in a comparison."""

    label: str  # e.g. "sglang-router cache_aware"
    package: PeerPackage
    policy: str
    disaggregated: bool = False
    """The peer's P/D mode over the fleet split by ``pd_roles`` (smg: SGLang's bootstrap
    protocol, to replicas owned by ``sglang``; vllm-router: vLLM's ``kv_transfer_params``)."""


PEERS: dict[str, PeerSpec] = {
    "sglang_cache_aware": PeerSpec("sglang-router cache_aware", SGLANG_ROUTER, "cache_aware"),
    "vllm_cache_aware": PeerSpec("vllm-router cache_aware", VLLM_ROUTER, "cache_aware"),
    "vllm_kv_aware": PeerSpec("vllm-router kv_aware", VLLM_ROUTER, "kv_aware"),
    "smg_cache_aware": PeerSpec("smg cache_aware", SMG, "cache_aware"),
    "smg_least_load": PeerSpec("smg least_load", SMG, "least_load"),
    "smg_prefix_hash": PeerSpec("smg prefix_hash", SMG, "prefix_hash"),
    "smg_power_of_two": PeerSpec("smg power_of_two", SMG, "power_of_two"),
    # disaggregated (docs/pd.md): the fleet's first half prefill, the rest decode
    "smg_pd": PeerSpec("smg P/D cache_aware", SMG, "cache_aware", disaggregated=True),
    "vllm_router_pd": PeerSpec(
        "vllm-router P/D cache_aware", VLLM_ROUTER, "cache_aware", disaggregated=True
    ),
    # not in the default comparison: a plain proxy baseline to separate proxy cost from policy
    "sglang_round_robin": PeerSpec("sglang-router round_robin", SGLANG_ROUTER, "round_robin"),
}

READINESS_PATH = {SGLANG_ROUTER.name: "/readiness", SMG.name: "/readiness"}
"""Where a peer says it routes: sglang-router and smg answer ``/health`` before their
workers are registered, ``/readiness`` only once they are; vllm-router's ``/health``."""


def peer_argv(
    spec: PeerSpec, bin_dir: Path, fleet: BenchFleet, port: int, prom_port: int, model: str
) -> list[str]:
    common = [
        "--host", LOOPBACK, "--port", str(port),
        "--prometheus-host", LOOPBACK, "--prometheus-port", str(prom_port),
        "--policy", spec.policy,
    ]  # fmt: skip
    argv = [*spec.package.launch(bin_dir), *common]
    if spec.disaggregated:
        return argv + pd_argv(spec, fleet.urls)
    argv += ["--worker-urls", *fleet.urls]
    if spec.package is not VLLM_ROUTER:
        return argv
    if spec.policy == "kv_aware":
        for url, events, replay in zip(
            fleet.urls, fleet.event_endpoints, fleet.replay_endpoints, strict=True
        ):
            argv += ["--kv-event-source", f"{url}={events}"]
            argv += ["--kv-event-replay-source", f"{url}={replay}"]
        argv += ["--kv-event-block-size", str(fleet.block_size), "--kv-event-model", model]
    return argv


def pd_argv(spec: PeerSpec, urls: Sequence[str]) -> list[str]:
    """A peer's P/D flags: ``--prefill URL [BOOTSTRAP_PORT]`` per prefill replica (the
    simulator's bootstrap server is its HTTP port), ``--decode URL`` per decode replica."""
    smg = spec.package is SMG
    out = ["--pd-disaggregation"] if smg else ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for url, role in zip(urls, pd_roles(len(urls)), strict=True):
        if role == "decode":
            out += ["--decode", url]
        else:
            out += ["--prefill", url, *([str(port_of(url))] if smg else [])]
    return out


class RouterProcess(Protocol):
    """What a comparison needs of a router it started: its CPU use and a way to stop it."""

    def cpu_seconds(self) -> float: ...

    def stop(self) -> None: ...


def start_peer(
    spec: PeerSpec,
    fleet: BenchFleet,
    log_dir: Path,
    model: str = "kvgate-sim",
    timeout_s: float = 90.0,
) -> tuple[ManagedProcess, str]:
    """Install if needed, launch on loopback and wait until it routes."""
    bin_dir = ensure_installed(spec.package, log_dir)
    port = bench_port_range(2, start=19000)
    argv = peer_argv(spec, bin_dir, fleet, port, port + 1, model)
    slug = spec.label.replace(" ", "-")
    proc = ManagedProcess(slug, argv, log_dir / f"{slug}.log").start()
    url = f"http://{LOOPBACK}:{port}"
    ready = READINESS_PATH.get(spec.package.name, "/health")
    try:
        wait_own_http(f"{url}{ready}", timeout_s, proc)
    except (TimeoutError, RuntimeError):
        proc.stop()
        raise
    return proc, url
