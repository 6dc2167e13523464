"""kvgate as the endpoint picker of a real Envoy against kvgate as the proxy, side by side.

    kvgate bench epp [--replicas 4] [--speedup 200] [--sessions 32] [--turns 4]
                     [--latency-connections 8] [--rate-connections 64] [--rate-requests 3200]
                     [--epp-replicas 2] [--out DIR]

One simulated fleet (``kvgate sim``, real HTTP and KV events) and the same traffic for every
target, run one after the other in one process:

``direct``        the client on the replicas themselves (a session keeps its replica): the
                  floor the others add to;
``kvgate serve``  client -> kvgate (kv policy) -> replica;
``envoy + epp``   client -> Envoy (deploy/envoy/envoy.yaml) -> replica, Envoy asking one
                  ``kvgate epp`` (kv policy) over ext_proc;
``envoy + N epp`` the same with N share-nothing ``kvgate epp`` replicas behind one Envoy (each
                  following every replica's KV events): its predictions must stay exact.

Traffic: multi-turn sessions (a shared system prompt, a distinct first message, each turn
the history plus a new question), streamed answers. For each target: the latency phase
(``--latency-connections`` sessions at a time, turn after turn) gives time to first byte and
to the whole answer (median, p99) and their increase over ``direct``; the rate phase
(``--rate-connections`` keep-alive connections, ``--rate-requests`` requests in all) gives
requests/s and the CPU seconds per request of the kvgate process(es) and of Envoy. Each
target's sessions are its own (a tag in every prompt), so no target profits from another's
cache. Predicted and engine-reported cached tokens are read from kvgate's /metrics (summed
over the epp replicas; in EPP mode they cover the answers kvgate reads, one in
``--answer-sample``: ``KVGATE_ANSWER_SAMPLE=1`` reads them all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvgate.backends.process import LOOPBACK, free_port
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.bench.envoy import Envoy, bootstrap
from kvgate.bench.fleet import (
    SIM_MODEL,
    FleetSpec,
    ManagedProcess,
    SimFleet,
    bench_port_range,
    kvgate_argv,
    port_of,
    process_cpu_seconds,
    start_fleet,
    wait_own_http,
)
from kvgate.bench.overhead import Connection, machine
from kvgate.bench.results import results_dir

SYSTEM = "You are a careful assistant. Answer briefly and cite what you rely on. " * 8
ANSWER = "Here is a short answer that the next turn keeps in its history. " * 3


@dataclass(frozen=True)
class Plan:
    sessions: int = 32
    turns: int = 4
    latency_connections: int = 8
    rate_connections: int = 64
    rate_requests: int = 3200
    max_tokens: int = 16


@dataclass
class Result:
    name: str
    ttfb: dict[str, float] = field(default_factory=dict)  # median_ms, p99_ms
    full: dict[str, float] = field(default_factory=dict)
    rps: float = 0.0
    kvgate_cpu_us: float | None = None  # per request, in the rate phase
    envoy_cpu_us: float | None = None
    predicted_cached: float | None = None
    engine_cached: float | None = None
    failed: int = 0


# -- traffic ---------------------------------------------------------------------------------


def session_bodies(tag: str, session: int, turns: int, max_tokens: int) -> list[bytes]:
    """One session's requests, turn by turn (each the history plus a new question)."""
    first = f"[{tag} session {session}] " + " ".join(
        f"fact{(session * 31 + i) % 997}" for i in range(160)
    )
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": first},
    ]
    bodies = []
    for turn in range(turns):
        body = {"model": SIM_MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
        bodies.append(json.dumps(body).encode())
        messages = [
            *messages,
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": f"and what about point {turn + 1}?"},
        ]
    return bodies


def raw_request(port: int, body: bytes) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def latency_phase(
    port_of: Callable[[int], int], tag: str, plan: Plan
) -> tuple[list[float], list[float], int]:
    """Sessions ``latency_connections`` at a time, each turn after the previous: TTFB and
    whole-answer seconds of every request, and the failures."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for session in range(plan.sessions):
        queue.put_nowait(session)
    ttfb: list[float] = []
    full: list[float] = []
    failed = 0

    async def worker() -> None:
        nonlocal failed
        while not queue.empty():
            session = queue.get_nowait()
            port = port_of(session)
            conn = await Connection.open(port)
            try:
                for body in session_bodies(tag, session, plan.turns, plan.max_tokens):
                    try:
                        first, end = await conn.call(raw_request(port, body))
                    except (RuntimeError, OSError, asyncio.IncompleteReadError):
                        failed += 1
                        await conn.close()
                        conn = await Connection.open(port)
                        continue
                    ttfb.append(first)
                    full.append(end)
            finally:
                await conn.close()

    await asyncio.gather(*(worker() for _ in range(plan.latency_connections)))
    return ttfb, full, failed


async def rate_phase(port_of: Callable[[int], int], tag: str, plan: Plan) -> tuple[int, float, int]:
    """``rate_connections`` connections, each its own session's turns over and over, until
    ``rate_requests`` in all: (answered, wall seconds, failed)."""
    per_connection = max(1, plan.rate_requests // plan.rate_connections)
    answered = failed = 0

    async def worker(number: int) -> None:
        nonlocal answered, failed
        port = port_of(number)
        bodies = session_bodies(f"{tag}-rate", number, plan.turns, plan.max_tokens)
        conn = await Connection.open(port)
        try:
            for i in range(per_connection):
                try:
                    await conn.call(raw_request(port, bodies[i % len(bodies)]))
                    answered += 1
                except (RuntimeError, OSError, asyncio.IncompleteReadError):
                    failed += 1
                    await conn.close()
                    conn = await Connection.open(port)
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(plan.rate_connections)))
    return answered, time.perf_counter() - start, failed


def _stats(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"median_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3}


# -- targets -------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port_of: Callable[[int], int]  # session -> the port its client talks to
    kvgate: list[ManagedProcess] = field(default_factory=list)
    metrics_urls: list[str] = field(default_factory=list)  # kvgate /metrics
    envoy: Envoy | None = None

    def kvgate_cpu(self) -> float:
        return sum(p.cpu_seconds() for p in self.kvgate)

    def envoy_cpu(self) -> float:
        return process_cpu_seconds(self.envoy.process.pid) if self.envoy is not None else 0.0

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for proc in self.kvgate:
            proc.stop()


def _worker_args(fleet: SimFleet) -> list[str]:
    args = ["--tokenizer", f"{SIM_MODEL}={tokenizer_dir()}", "--log-level", "warning"]
    for url, events, replay in zip(
        fleet.urls, fleet.event_endpoints, fleet.replay_endpoints, strict=True
    ):
        args += ["--worker", f"{url},models={SIM_MODEL},events={events},replay={replay}"]
    return args


def start_serve(fleet: SimFleet, log_dir: Path) -> Target:
    port = bench_port_range(1, start=18000)
    argv = kvgate_argv("serve", "--host", LOOPBACK, "--port", str(port), *_worker_args(fleet))
    proc = ManagedProcess("kvgate-serve", argv, log_dir / "kvgate-serve.log").start()
    url = f"http://{LOOPBACK}:{port}"
    wait_own_http(f"{url}/ready", 60, proc)
    return Target("kvgate serve", lambda _: port, [proc], [f"{url}/metrics"])


def start_epp(fleet: SimFleet, log_dir: Path, replicas: int) -> Target:
    procs, grpc_ports, metrics = [], [], []
    target = Target("", lambda _: 0)
    try:
        for number in range(replicas):
            http_port, grpc_port = free_port(), free_port()
            argv = kvgate_argv(
                "epp", "--host", LOOPBACK, "--port", str(http_port), "--grpc-port",
                str(grpc_port), *_worker_args(fleet),
            )  # fmt: skip
            name = f"kvgate-epp-{replicas}x{number}"
            proc = ManagedProcess(name, argv, log_dir / f"{name}.log").start()
            procs.append(proc)
            target.kvgate = procs
            wait_own_http(f"http://{LOOPBACK}:{http_port}/ready", 60, proc)
            grpc_ports.append(grpc_port)
            metrics.append(f"http://{LOOPBACK}:{http_port}/metrics")
        config = bootstrap(
            listen_port=free_port(),
            admin_port=free_port(),
            epp=[f"{LOOPBACK}:{p}" for p in grpc_ports],
            pool=[url.removeprefix("http://") for url in fleet.urls],
        )
        envoy = Envoy(config, log_dir, name=f"envoy-{replicas}epp", concurrency=1).start()
    except BaseException:
        target.stop()
        raise
    name = "envoy + epp" if replicas == 1 else f"envoy + {replicas} epp"
    return Target(name, lambda _: envoy.port, procs, metrics, envoy)


def cached_tokens(metrics_urls: Sequence[str]) -> tuple[float, float]:
    """(predicted, engine-reported) cached tokens, summed over workers and kvgate processes."""
    predicted = engine = 0.0
    for url in metrics_urls:
        for line in httpx.get(url, timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("kvgate_predicted_cached_tokens_total{"):
                predicted += float(value)
            elif name.startswith("kvgate_engine_cached_tokens_total{"):
                engine += float(value)
    return predicted, engine


def measure(target: Target, plan: Plan) -> Result:
    import uvloop  # noqa: PLC0415

    result = Result(target.name)
    tag = target.name.replace(" ", "")
    ttfb, full, failed = uvloop.run(latency_phase(target.port_of, tag, plan))
    result.ttfb, result.full, result.failed = _stats(ttfb), _stats(full), failed
    kvgate_before, envoy_before = target.kvgate_cpu(), target.envoy_cpu()
    answered, wall, failed = uvloop.run(rate_phase(target.port_of, tag, plan))
    result.failed += failed
    result.rps = answered / wall if wall > 0 else 0.0
    if answered and target.kvgate:
        result.kvgate_cpu_us = (target.kvgate_cpu() - kvgate_before) / answered * 1e6
    if answered and target.envoy is not None:
        result.envoy_cpu_us = (target.envoy_cpu() - envoy_before) / answered * 1e6
    if target.metrics_urls:
        result.predicted_cached, result.engine_cached = cached_tokens(target.metrics_urls)
    return result


def run(spec: FleetSpec, plan: Plan, epp_replicas: int, log_dir: Path) -> list[Result]:
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = start_fleet(spec, log_dir)
    results = []
    try:
        ports = [port_of(url) for url in fleet.urls]
        starts: list[Callable[[], Target]] = [
            lambda: Target("direct", lambda session: ports[session % len(ports)]),
            lambda: start_serve(fleet, log_dir),
            lambda: start_epp(fleet, log_dir, 1),
        ]
        if epp_replicas > 1:
            starts.append(lambda: start_epp(fleet, log_dir, epp_replicas))
        for start in starts:
            target = start()
            try:
                results.append(measure(target, plan))
            finally:
                target.stop()
            print(json.dumps(asdict(results[-1])), flush=True)
    finally:
        fleet.stop()
    return results


def markdown(results: Sequence[Result]) -> str:
    direct = results[0]
    lines = [
        "| target | TTFB p50 / p99 (ms) | added p50 / p99 | answer p50 / p99 (ms) | added p50 / "
        "p99 | req/s at 64 conn. | kvgate CPU µs/req | Envoy CPU µs/req | predicted = engine "
        "cached | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(values: dict[str, float]) -> str:
        return f"{values['median_ms']:.2f} / {values['p99_ms']:.2f}"

    def added(values: dict[str, float], base: dict[str, float]) -> str:
        return (
            f"{values['median_ms'] - base['median_ms']:+.2f} / "
            f"{values['p99_ms'] - base['p99_ms']:+.2f}"
        )

    for r in results:
        cpu = f"{r.kvgate_cpu_us:.0f}" if r.kvgate_cpu_us is not None else "-"
        envoy = f"{r.envoy_cpu_us:.0f}" if r.envoy_cpu_us is not None else "-"
        exact = "-"
        if r.predicted_cached is not None:
            same = "yes" if r.predicted_cached == r.engine_cached else "NO"
            exact = f"{same} ({r.predicted_cached:.0f} / {r.engine_cached:.0f})"
        lines.append(
            f"| {r.name} | {pair(r.ttfb)} | {added(r.ttfb, direct.ttfb)} | {pair(r.full)} | "
            f"{added(r.full, direct.full)} | {r.rps:.0f} | {cpu} | {envoy} | {exact} | "
            f"{r.failed} |"
        )
    return "\n".join(lines)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas")
    parser.add_argument(
        "--speedup", type=float, default=200.0, help="simulator speed-up (answers take ms)"
    )
    parser.add_argument("--sessions", type=int, default=Plan.sessions)
    parser.add_argument("--turns", type=int, default=Plan.turns)
    parser.add_argument("--latency-connections", type=int, default=Plan.latency_connections)
    parser.add_argument("--rate-connections", type=int, default=Plan.rate_connections)
    parser.add_argument("--rate-requests", type=int, default=Plan.rate_requests)
    parser.add_argument(
        "--epp-replicas", type=int, default=2, help="kvgate epp replicas behind one Envoy"
    )
    parser.add_argument("--out", type=Path, default=None, help="results directory")


def main(args: argparse.Namespace) -> int:
    out: Path = args.out or results_dir() / "epp"
    plan = Plan(
        sessions=args.sessions,
        turns=args.turns,
        latency_connections=args.latency_connections,
        rate_connections=args.rate_connections,
        rate_requests=args.rate_requests,
    )
    spec = FleetSpec(replicas=args.replicas, speedup=args.speedup)
    results = run(spec, plan, args.epp_replicas, out)
    table = markdown(results)
    header = f"{machine()}; {args.replicas} simulated replicas x{args.speedup:g}; {plan}"
    (out / "epp.md").write_text(f"{header}\n\n{table}\n")
    (out / "epp.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"\n{header}\n\n{table}")
    return 0 if all(r.failed == 0 for r in results) else 1


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvgate bench epp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_args(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    import sys

    raise SystemExit(cli(sys.argv[1:]))
