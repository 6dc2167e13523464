"""Peer routers for side-by-side runs: sglang-router and vllm-router, each in its own venv
under ``.engines/`` and bound to 127.0.0.1 (serving and Prometheus ports alike)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from backends.process import LOOPBACK
from bench.fleet import ManagedProcess, SimFleet, bench_port_range, wait_own_http

ENGINES_DIR = Path(__file__).resolve().parent.parent / ".engines"


@dataclass(frozen=True, slots=True)
class PeerPackage:
    name: str  # venv folder under .engines/
    requirement: str
    module: str  # its entry point, run as ``python -m <module>``

    def launch(self, bin_dir: Path) -> list[str]:
        """The command that starts it: its venv's interpreter running the module, not a
        console script, whose shebang names the path the venv was built at (a venv reused
        from a moved checkout would fail to start it)."""
        return [str(bin_dir / "python"), "-m", self.module]


SGLANG_ROUTER = PeerPackage("sglang-router", "sglang-router==0.3.2", "sglang_router.launch_router")
VLLM_ROUTER = PeerPackage("vllm-router", "vllm-router==0.1.17", "vllm_router.launch_router")


def venv_python(pkg: PeerPackage) -> Path:
    return ENGINES_DIR / pkg.name / "bin" / "python"


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
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", pkg.requirement],
            check=True,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    marker.write_text(pkg.requirement + "\n")
    return python.parent


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One peer router configuration in a comparison."""

    label: str  # e.g. "sglang-router cache_aware"
    package: PeerPackage
    policy: str


PEERS: dict[str, PeerSpec] = {
    "sglang_cache_aware": PeerSpec("sglang-router cache_aware", SGLANG_ROUTER, "cache_aware"),
    "vllm_cache_aware": PeerSpec("vllm-router cache_aware", VLLM_ROUTER, "cache_aware"),
    "vllm_kv_aware": PeerSpec("vllm-router kv_aware", VLLM_ROUTER, "kv_aware"),
    # not in the default comparison: a plain proxy baseline to separate proxy cost from policy
    "sglang_round_robin": PeerSpec("sglang-router round_robin", SGLANG_ROUTER, "round_robin"),
}


def peer_argv(
    spec: PeerSpec, bin_dir: Path, fleet: SimFleet, port: int, prom_port: int, model: str
) -> list[str]:
    common = [
        "--host", LOOPBACK, "--port", str(port),
        "--prometheus-host", LOOPBACK, "--prometheus-port", str(prom_port),
        "--policy", spec.policy,
        "--worker-urls", *fleet.urls,
    ]  # fmt: skip
    argv = [*spec.package.launch(bin_dir), *common]
    if spec.package is SGLANG_ROUTER:
        return argv
    if spec.policy == "kv_aware":
        for url, events, replay in zip(
            fleet.urls, fleet.event_endpoints, fleet.replay_endpoints, strict=True
        ):
            argv += ["--kv-event-source", f"{url}={events}"]
            argv += ["--kv-event-replay-source", f"{url}={replay}"]
        argv += ["--kv-event-block-size", str(fleet.spec.block_size), "--kv-event-model", model]
    return argv


def start_peer(
    spec: PeerSpec,
    fleet: SimFleet,
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
    ready = "/readiness" if spec.package is SGLANG_ROUTER else "/health"
    try:
        wait_own_http(f"{url}{ready}", timeout_s, proc)
    except (TimeoutError, RuntimeError):
        proc.stop()
        raise
    return proc, url
