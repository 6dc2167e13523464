"""Gateway overhead: the latency kvgate adds in front of an engine, and its top request rate.

    python -m kvgate.bench.overhead [--sequential 1000] [--concurrent 64] [--per-stream 25]
                             [--rps-requests 6400] [--rounds 1] [--only NAME ...]
                             [--baseline DIR] [--json results.json]

One run measures, against the same instant fake engine (a subprocess on 127.0.0.1):
``direct`` (no router), ``kvgate round_robin`` (pure proxy path, no block index),
``kvgate kv`` (tokenizer + block index + cost policy; logging at warning: no access log),
``kvgate kv +access log`` (the same at info with ``--log-format json``: one access line per
request), ``kvgate kv +tracing`` (every request traced, spans exported over OTLP/HTTP to the
engine process, which accepts and drops them) and ``+tracing 10%`` (``--trace-sample-rate
0.1``), and ``sglang-router round_robin`` (0.3.2, installed into ``.engines/sglang-router``).
``--baseline DIR`` adds ``kvgate kv (baseline)``: the same ``kvgate kv`` run from another
source tree (e.g. ``git archive main``, with its native core built or copied in), to compare
a change against the code before it. Pick targets with ``--only NAME`` (repeatable).

For each: sequential and 64-concurrent latency of non-streaming requests and time to first
body byte of streaming ones (median, p99), then the most requests/s at 64 connections, and
the router process's CPU time per request. The load generator is a minimal keep-alive
HTTP/1.1 client on uvloop, so the client's own cost stays small and identical for every
target. Added latency = target minus direct, per statistic.

``--rounds N`` starts every target once and measures them N times, interleaved (forward,
then backward, ...), so that noise from a shared machine falls on every target alike; the
report gives each figure's median over the rounds and its range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODEL = "bench-model"
CHAT_PATH = "/v1/chat/completions"
LOOPBACK = "127.0.0.1"

# --------------------------------------------------------------------------- fake engine

_USAGE_FIELDS = {"prompt_tokens": 200, "completion_tokens": 4, "total_tokens": 204,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
_MESSAGE = {"role": "assistant", "content": "ok"}
_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": _MESSAGE, "finish_reason": "stop"}],
        "usage": _USAGE_FIELDS,
    }
).encode()
_CHUNK_FIELDS = {"id": "c", "object": "chat.completion.chunk", "model": MODEL}
_CHUNK = (
    b"data: "
    + json.dumps({**_CHUNK_FIELDS, "choices": [{"index": 0, "delta": {"content": "ok"}}]}).encode()
    + b"\n\n"
)
_USAGE = (
    b"data: "
    + json.dumps({**_CHUNK_FIELDS, "choices": [], "usage": _USAGE_FIELDS}).encode()
    + b"\n\n"
)
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
).encode()
_JSON = [(b"content-type", b"application/json")]


async def engine_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An engine that answers at once: JSON, or 4 SSE chunks (+ usage when asked) and [DONE]."""
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    path = scope["path"]
    if path == "/v1/traces":  # the OTLP/HTTP sink of the traced targets: accept, drop
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-protobuf")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["method"] == "POST" and path.startswith("/v1/"):
        if b'"stream":true' in body.replace(b" ", b""):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            for _ in range(4):
                await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
            if b'"include_usage":true' in body.replace(b" ", b""):
                await send({"type": "http.response.body", "body": _USAGE, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        payload = _COMPLETION
    elif path == "/v1/models":
        payload = _MODELS
    elif path == "/metrics":
        payload = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    else:  # /health, /get_model_info, /get_server_info, ...
        payload = b"{}"
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_JSON, (b"content-length", str(len(payload)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


def run_engine(port: int) -> None:
    import uvicorn  # noqa: PLC0415

    uvicorn.run(engine_app, host=LOOPBACK, port=port, loop="uvloop", http="httptools",
                ws="none", lifespan="off", access_log=False, log_level="warning")  # fmt: skip


# --------------------------------------------------------------------------- load client


def request_bytes(port: int, stream: bool) -> bytes:
    words = " ".join(f"word{i % 50}" for i in range(200))
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": words},
            ],
            "max_tokens": 4,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Connection:
    """One keep-alive HTTP/1.1 connection; ``call`` returns (first body byte, end) seconds."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        return cls(reader, writer)

    async def call(self, raw: bytes) -> tuple[float, float]:
        start = time.perf_counter()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {head[:200]!r}")
        lower = head.lower()
        first = 0.0
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                await self.reader.readexactly(size + 2)
                first = first or time.perf_counter()
        else:
            at = lower.index(b"content-length:") + len(b"content-length:")
            length = int(lower[at : lower.index(b"\r\n", at)])
            await self.reader.readexactly(length)
            first = time.perf_counter()
        end = time.perf_counter()
        return first - start, end - start

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def run_load(
    port: int, *, stream: bool, connections: int, per_connection: int
) -> tuple[list[float], float]:
    """Latencies (TTFB when streaming, else full response) and the wall time of the run."""
    raw = request_bytes(port, stream)
    conns = [await Connection.open(port) for _ in range(connections)]
    samples: list[float] = []

    async def worker(conn: Connection) -> None:
        for _ in range(per_connection):
            ttfb, total = await conn.call(raw)
            samples.append(ttfb if stream else total)

    try:
        for conn in conns:  # warm every connection (and the target's pools)
            for _ in range(3):
                await conn.call(raw)
        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        wall = time.perf_counter() - start
    finally:
        for conn in conns:
            await conn.close()
    return samples, wall


# --------------------------------------------------------------------------- measuring


@dataclass
class Stats:
    median_ms: float
    p99_ms: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        ordered = sorted(samples)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return cls(statistics.median(ordered) * 1e3, p99 * 1e3, len(ordered))


@dataclass
class TargetResult:
    name: str
    stats: dict[str, Stats] = field(default_factory=dict)
    max_rps: float = 0.0
    cpu_us_per_request: dict[str, float] = field(default_factory=dict)  # router process


@dataclass(frozen=True)
class Plan:
    sequential: int
    concurrent: int
    per_stream: int
    rps_requests: int


async def measure(name: str, port: int, plan: Plan, cpu: Callable[[], float]) -> TargetResult:
    """Every phase against one target; ``cpu`` reads the router's CPU seconds (0 if none)."""
    result = TargetResult(name)
    for stream in (False, True):
        label = "ttfb" if stream else "full"
        used = cpu()
        seq, _ = await run_load(port, stream=stream, connections=1, per_connection=plan.sequential)
        kind = "stream" if stream else "json"
        result.cpu_us_per_request[f"sequential {kind}"] = (
            (cpu() - used) / (plan.sequential + 3) * 1e6
        )
        result.stats[f"sequential {label}"] = Stats.of(seq)
        conc, _ = await run_load(
            port, stream=stream, connections=plan.concurrent, per_connection=plan.per_stream
        )
        result.stats[f"{plan.concurrent} concurrent {label}"] = Stats.of(conc)
    per_conn = max(1, plan.rps_requests // plan.concurrent)
    used = cpu()
    _, wall = await run_load(
        port, stream=False, connections=plan.concurrent, per_connection=per_conn
    )
    result.max_rps = per_conn * plan.concurrent / wall
    result.cpu_us_per_request["rate run json"] = (
        (cpu() - used) / ((per_conn + 3) * plan.concurrent) * 1e6
    )
    return result


# --------------------------------------------------------------------------- processes


def _targets(
    engine_url: str, log_dir: Path, baseline: Path | None
) -> list[tuple[str, Callable[[], Any]]]:
    """(name, start) per routed target; ``start`` returns (process, port)."""
    from kvgate.backends.process import free_port_range, wait_http  # noqa: PLC0415
    from kvgate.backends.sim.tokenizer import tokenizer_dir  # noqa: PLC0415
    from kvgate.bench.fleet import ManagedProcess, kvgate_argv  # noqa: PLC0415
    from kvgate.bench.peers import SGLANG_ROUTER, ensure_installed  # noqa: PLC0415

    def kvgate(
        policy: str, *extra: str, label: str = "", cwd: Path | None = None
    ) -> Callable[[], Any]:
        name = f"kvgate-{policy}{label}"

        def start() -> Any:
            port = free_port_range(1, start=18100)
            argv = kvgate_argv(
                "serve", "--host", LOOPBACK, "--port", str(port), "--policy", policy,
                "--worker", f"{engine_url},models={MODEL}", "--log-level", "warning", *extra,
            )  # fmt: skip
            log_path = log_dir / f"overhead-{name}.log"
            proc = ManagedProcess(name, argv, log_path, cwd=cwd).start()
            wait_http(f"http://{LOOPBACK}:{port}/ready", 60, proc)
            return proc, port

        return start

    def sglang() -> Any:
        bin_dir = ensure_installed(SGLANG_ROUTER, log_dir)
        port = free_port_range(2, start=19100)
        argv = [
            *SGLANG_ROUTER.launch(bin_dir),
            "--host", LOOPBACK, "--port", str(port),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(port + 1),
            "--worker-urls", engine_url, "--policy", "round_robin",
        ]  # fmt: skip
        proc = ManagedProcess("sglang-router", argv, log_dir / "overhead-sglang-router.log").start()
        wait_http(f"http://{LOOPBACK}:{port}/readiness", 90, proc)
        return proc, port

    kv = ("--tokenizer", f"{MODEL}={tokenizer_dir()}")
    # the engine process doubles as the OTLP/HTTP sink (it answers POST /v1/traces)
    traced = (*kv, "--otlp-traces-endpoint", f"{engine_url}/v1/traces")
    # ``python -m`` puts the working directory first on sys.path: the baseline's code runs
    before = [("kvgate kv (baseline)", kvgate("kv", *kv, label="-baseline", cwd=baseline))]
    return [
        ("kvgate round_robin", kvgate("round_robin", "--no-kv-index")),
        *(before if baseline is not None else []),
        ("kvgate kv", kvgate("kv", *kv)),
        # the access log is on by default, at info: the targets above run at warning
        (
            "kvgate kv +access log",
            kvgate("kv", *kv, "--log-level", "info", "--log-format", "json", label="-access"),
        ),
        ("kvgate kv +tracing", kvgate("kv", *traced, label="-traced")),
        (
            "kvgate kv +tracing 10%",
            kvgate("kv", *traced, "--trace-sample-rate", "0.1", label="-traced10"),
        ),
        ("sglang-router round_robin", sglang),
    ]


def run_all(
    plan: Plan,
    log_dir: Path,
    only: set[str] | None,
    *,
    rounds: int = 1,
    baseline: Path | None = None,
) -> list[list[TargetResult]]:
    """Every target's results, one list per target (direct first), one entry per round."""
    from kvgate.backends.process import free_port_range, wait_http  # noqa: PLC0415
    from kvgate.bench.fleet import ManagedProcess  # noqa: PLC0415

    engine_port = free_port_range(1, start=18000)
    engine = ManagedProcess(
        "overhead-engine",
        [sys.executable, "-m", "kvgate.bench.overhead", "engine", "--port", str(engine_port)],
        log_dir / "overhead-engine.log",
    ).start()
    running: list[tuple[str, int, Callable[[], float], Any]] = []
    try:
        engine_url = f"http://{LOOPBACK}:{engine_port}"
        wait_http(f"{engine_url}/health", 30, engine)
        running.append(("direct", engine_port, lambda: 0.0, None))
        for name, start in _targets(engine_url, log_dir, baseline):
            if only is None or name in only:
                proc, port = start()
                running.append((name, port, proc.cpu_seconds, proc))
        results: dict[str, list[TargetResult]] = {name: [] for name, *_ in running}
        for number in range(rounds):
            order = running if number % 2 == 0 else running[::-1]
            for name, port, cpu, _ in order:
                results[name].append(_run(measure(name, port, plan, cpu)))
        return [results[name] for name, *_ in running]
    finally:
        for *_, proc in running[::-1]:
            if proc is not None:
                proc.stop()
        engine.stop()


def _run(coro: Awaitable[TargetResult]) -> TargetResult:
    import uvloop  # noqa: PLC0415

    async def wrapped() -> TargetResult:
        return await coro

    return uvloop.run(wrapped())


# --------------------------------------------------------------------------- report


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    system = f"{platform.system()} {platform.release()}"
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {system}"


def markdown(results: list[TargetResult]) -> str:
    direct = results[0]
    keys = list(direct.stats)
    lines = [
        "| target | " + " | ".join(f"{k} p50 / p99 (ms)" for k in keys) + " | max req/s |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for r in results:
        cells = [f"{r.stats[k].median_ms:.2f} / {r.stats[k].p99_ms:.2f}" for k in keys]
        lines.append(f"| {r.name} | " + " | ".join(cells) + f" | {r.max_rps:.0f} |")
    lines += ["", "| added vs direct | " + " | ".join(f"{k} p50 / p99 (ms)" for k in keys) + " |",
              "|---" * (len(keys) + 1) + "|"]  # fmt: skip
    for r in results[1:]:
        cells = [
            f"{r.stats[k].median_ms - direct.stats[k].median_ms:+.2f} / "
            f"{r.stats[k].p99_ms - direct.stats[k].p99_ms:+.2f}"
            for k in keys
        ]
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    cpu_keys = list(results[-1].cpu_us_per_request) if len(results) > 1 else []
    lines += ["", "| router CPU per request (µs) | " + " | ".join(cpu_keys) + " |",
              "|---" * (len(cpu_keys) + 1) + "|"]  # fmt: skip
    for r in results[1:]:
        cells = [f"{r.cpu_us_per_request.get(k, 0.0):.0f}" for k in cpu_keys]
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(values: list[float], digits: int) -> str:
    """One figure over the rounds: ``median [min-max]`` (the median alone for one round)."""
    middle = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return middle
    return f"{middle} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def markdown_rounds(results: list[list[TargetResult]]) -> str:
    """Each target's median over the rounds and the range, per statistic; then the router's
    CPU per request and the top rate the same way."""
    keys = list(results[0][0].stats)
    lines = [
        "| target | " + " | ".join(f"{k} p50 (ms)" for k in keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    for rounds in results:
        cells = [_spread([r.stats[k].median_ms for r in rounds], 3) for k in keys]
        lines.append(f"| {rounds[0].name} | " + " | ".join(cells) + " |")
    lines += ["", "| target | " + " | ".join(f"{k} p99 (ms)" for k in keys) + " |",
              "|---" * (len(keys) + 1) + "|"]  # fmt: skip
    for rounds in results:
        cells = [_spread([r.stats[k].p99_ms for r in rounds], 2) for k in keys]
        lines.append(f"| {rounds[0].name} | " + " | ".join(cells) + " |")
    routed = results[1:]
    cpu_keys = list(routed[0][0].cpu_us_per_request) if routed else []
    lines += ["", "| target | " + " | ".join(f"CPU µs/request, {k}" for k in cpu_keys)
              + " | max req/s |", "|---" * (len(cpu_keys) + 2) + "|"]  # fmt: skip
    for rounds in routed:
        cells = [_spread([r.cpu_us_per_request[k] for r in rounds], 0) for k in cpu_keys]
        rate = _spread([r.max_rps for r in rounds], 0)
        lines.append(f"| {rounds[0].name} | " + " | ".join(cells) + f" | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["engine"]:
        parser = argparse.ArgumentParser(prog="bench.overhead engine")
        parser.add_argument("--port", type=int, required=True)
        run_engine(parser.parse_args(args[1:]).port)
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m kvgate.bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sequential", type=int, default=1000, help="requests, one connection")
    parser.add_argument("--concurrent", type=int, default=64, help="parallel connections")
    parser.add_argument("--per-stream", type=int, default=25, help="requests per connection")
    parser.add_argument("--rps-requests", type=int, default=6400, help="requests of the rate run")
    parser.add_argument("--only", action="append", help="routed targets to run (default: all)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every target this many times, interleaved"
    )
    parser.add_argument(
        "--baseline", type=Path, help="a kvgate source tree run as 'kvgate kv (baseline)'"
    )
    parser.add_argument("--logs", type=Path, default=Path(".engines/logs"), help="process logs")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    ns = parser.parse_args(args)
    plan = Plan(ns.sequential, ns.concurrent, ns.per_stream, ns.rps_requests)
    started = time.time()
    if ns.rounds < 1:
        parser.error("--rounds must be at least 1")
    only = set(ns.only) if ns.only else None
    results = run_all(plan, ns.logs, only, rounds=ns.rounds, baseline=ns.baseline)
    print(f"machine: {machine()}")
    print(f"plan: {plan}, {ns.rounds} round(s); {time.time() - started:.0f} s\n")
    print(markdown([r[0] for r in results]) if ns.rounds == 1 else markdown_rounds(results))
    if ns.json is not None:
        report = {
            "machine": machine(),
            "plan": asdict(plan),
            "rounds": ns.rounds,
            "results": [[asdict(r) for r in rounds] for rounds in results],
        }
        ns.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
