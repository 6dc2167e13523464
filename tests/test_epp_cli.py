"""``kvgate epp``'s command line: every option of ``kvgate serve`` (same names), its own
``--grpc-port``; and the real process with ``--sim N`` (replicas where ``serve --sim N``
puts them) behind a real Envoy, stopped by SIGTERM with its replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.backends.process import ChildProcess, free_port, free_port_range
from kvgate.bench.envoy import Envoy, bootstrap
from kvgate.router.epp.cli import build_parser, main
from kvgate.router.serve import build_parser as serve_parser
from kvgate.router.simfleet import SIM_MODEL

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent


def options(parser: object) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}  # type: ignore[attr-defined]


def test_epp_takes_every_serve_option_and_its_grpc_port() -> None:
    serve, epp = options(serve_parser()), options(build_parser())
    assert serve <= epp
    assert epp - serve == {
        "--grpc-port",
        "--answer-sample",
        "--conformance-headers",
        "--no-conformance-headers",
    }
    parsed = build_parser().parse_args(["--grpc-port", "9100", "--sim", "2"])
    assert vars(parsed)["grpc_port"] == "9100" and vars(parsed)["sim"] == "2"


def test_a_grpc_port_among_the_simulated_replicas_ports_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--sim", "4", "--grpc-port", "9002"]) == 2  # replicas on 9001..9004
    assert "--grpc-port 9002 is a port of the simulated replicas" in capsys.readouterr().err
    assert main(["--port", "9100", "--grpc-port", "9100"]) == 2


def refuses(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) != 0


async def test_the_epp_process_with_simulated_replicas_behind_envoy(tmp_path: Path) -> None:
    sim_port = free_port_range(2, start=31000)
    events_port = free_port_range(4, start=33000)
    grpc_port, http_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    argv = [
        sys.executable, "-m", "kvgate.router.cli", "epp", "--sim", "2", "--sim-port", str(sim_port),
        "--sim-events-port", str(events_port), "--grpc-port", str(grpc_port),
        "--port", str(http_port), "--log-level", "warning",
    ]  # fmt: skip
    log = tmp_path / "epp.log"
    process = ChildProcess(
        argv, name="kvgate epp", log_path=log, env=env, cwd=ROOT, own_group=False
    )
    process.start()
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            async with asyncio.timeout(90):
                while True:
                    assert process.alive(), log.read_text()
                    try:
                        if (await client.get(f"http://127.0.0.1:{http_port}/ready")).is_success:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness")
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        pool = [f"127.0.0.1:{sim_port + i}" for i in range(2)]  # where serve --sim 2 puts them
        config = bootstrap(
            listen_port=free_port(),
            admin_port=free_port(),
            epp=[f"127.0.0.1:{grpc_port}"],
            pool=pool,
        )
        envoy = await asyncio.to_thread(Envoy(config, tmp_path).start)
        try:
            async with httpx.AsyncClient(base_url=envoy.url, timeout=30.0) as client:
                body = {"model": SIM_MODEL, "prompt": "hello there", "max_tokens": 2}
                reply = await client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                served = reply.headers["x-kvgate-worker"]
                assert served in {f"http://{endpoint}" for endpoint in pool}
        finally:
            envoy.stop()
        process.terminate()  # SIGTERM to kvgate epp alone: it stops its replicas itself
        popen = process.popen
        assert popen is not None
        assert await asyncio.to_thread(popen.wait, 30) in (0, -signal.SIGTERM)
        assert all(refuses(sim_port + i) for i in range(2))  # its replicas went with it
        assert refuses(grpc_port)
    finally:
        process.stop()
