"""How many simulated requests per second one ``kvgate sim`` process serves on one core.

Starts ``kvgate sim --replicas N`` pinned to one core (taskset), drives it from this process
(pinned to another core) with a closed loop of keep-alive HTTP/1.1 connections sending short
chat requests, subscribes to every replica's KV events (so publishing is real work), and
reports the completed requests/s and the simulator's CPU use over a bounded window.

    .venv/bin/python bench/sim_throughput.py --replicas 8 --duration 10 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop
import zmq
import zmq.asyncio

from kvgate.backends.process import LOOPBACK, free_port_range, wait_http
from kvgate.backends.sim.vocab import GENERATED_WORDS, generated_word
from kvgate.bench.fleet import ManagedProcess, kvgate_argv


@dataclass
class Result:
    replicas: int
    concurrency: int
    duration_s: float
    requests: int
    errors: int
    requests_per_s: float
    sim_cpu_share: float
    """CPU seconds of the simulator per wall second (1.0 = one core busy)."""
    client_cpu_share: float
    """The same for this load generator."""
    event_batches: int
    p50_ms: float
    p99_ms: float
    prompt_words: int
    max_tokens: int
    machine: str


def _prompt(rng: random.Random, words: int) -> bytes:
    text = " ".join(generated_word(rng.randrange(GENERATED_WORDS)) for _ in range(words))
    body = {
        "model": "kvgate-sim",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 0,
    }
    return json.dumps(body).encode()


class Client:
    """One keep-alive HTTP/1.1 connection sending POST /v1/chat/completions in a loop."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, body: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _count_events(endpoints: list[str], stop: asyncio.Event) -> int:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for endpoint in endpoints:
        sub.connect(endpoint)
    batches = 0
    try:
        while not stop.is_set():
            if await sub.poll(100):
                await sub.recv_multipart()
                batches += 1
    finally:
        sub.close(linger=0)
        ctx.term()
    return batches


async def _drive(
    urls: list[tuple[str, int]], args: argparse.Namespace, sim: ManagedProcess
) -> tuple[int, int, list[float], float, float, float]:
    rng = random.Random(args.seed)
    bodies = []
    for _ in range(256):
        body = json.loads(_prompt(rng, args.prompt_words))
        body["max_tokens"] = args.max_tokens
        bodies.append(json.dumps(body).encode())
    clients = [Client(*urls[i % len(urls)]) for i in range(args.concurrency)]
    done = errors = 0
    latencies: list[float] = []
    measuring = False
    stop_at = time.monotonic() + args.warmup + args.duration

    async def loop(client: Client, k: int) -> None:
        nonlocal done, errors
        i = k
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            try:
                status = await client.request(bodies[i % len(bodies)])
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                errors += 1
                client.close()
                client.writer = None
                await asyncio.sleep(0.05)
                continue
            if measuring:
                if status == 200:
                    done += 1
                    latencies.append(time.monotonic() - t0)
                else:
                    errors += 1
            i += 1

    tasks = [asyncio.create_task(loop(c, k)) for k, c in enumerate(clients)]
    await asyncio.sleep(args.warmup)
    measuring = True
    cpu0, own0, t0 = sim.cpu_seconds(), time.process_time(), time.monotonic()
    await asyncio.sleep(args.duration)
    cpu1, own1, t1 = sim.cpu_seconds(), time.process_time(), time.monotonic()
    measuring = False
    await asyncio.gather(*tasks)
    for c in clients:
        c.close()
    return done, errors, latencies, (cpu1 - cpu0), (own1 - own0), (t1 - t0)


def _machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


async def main_async(args: argparse.Namespace) -> Result:
    http_port = free_port_range(args.replicas, start=31000)
    events_port = free_port_range(2 * args.replicas, start=33000)
    argv = kvgate_argv(
        "sim", "--replicas", str(args.replicas), "--host", LOOPBACK, "--port", str(http_port),
        "--events-port", str(events_port), "--speedup", str(args.speedup),
    )  # fmt: skip
    if args.sim_cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(args.sim_cpu), *argv]
    sim = ManagedProcess("sim", argv, Path(args.log_dir) / "sim_throughput.log").start()
    try:
        for i in range(args.replicas):
            wait_http(f"http://{LOOPBACK}:{http_port + i}/health", 60.0, sim)
        urls = [(LOOPBACK, http_port + i) for i in range(args.replicas)]
        endpoints = [f"tcp://{LOOPBACK}:{events_port + 2 * i}" for i in range(args.replicas)]
        stop = asyncio.Event()
        counter = asyncio.create_task(_count_events(endpoints, stop))
        done, errors, latencies, cpu_s, own_s, wall_s = await _drive(urls, args, sim)
        stop.set()
        batches = await counter
    finally:
        sim.stop()
    latencies.sort()

    def pct(q: float) -> float:
        return (
            1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0
        )

    return Result(
        replicas=args.replicas,
        concurrency=args.concurrency,
        duration_s=round(wall_s, 2),
        requests=done,
        errors=errors,
        requests_per_s=round(done / wall_s, 1),
        sim_cpu_share=round(cpu_s / wall_s, 3),
        client_cpu_share=round(own_s / wall_s, 3),
        event_batches=batches,
        p50_ms=round(pct(0.5), 2),
        p99_ms=round(pct(0.99), 2),
        prompt_words=args.prompt_words,
        max_tokens=args.max_tokens,
        machine=_machine(),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=64, help="keep-alive connections")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds (bounded)")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--prompt-words", type=int, default=24, help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--sim-cpu", type=int, default=0, help="core the simulator is pinned to")
    p.add_argument("--client-cpu", type=int, default=1, help="core this load generator uses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="bench-results")
    args = p.parse_args(argv)
    if args.duration > 300 or args.warmup > 60:
        p.error("keep runs bounded: --duration <= 300, --warmup <= 60")
    if args.client_cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.client_cpu})
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(main_async(args))
    print(json.dumps(asdict(result)))
    print(
        f"{result.requests_per_s} req/s from {result.replicas} replicas in one process "
        f"(simulator CPU {result.sim_cpu_share:.2f} core, load generator "
        f"{result.client_cpu_share:.2f}), p50 {result.p50_ms} ms, "
        f"p99 {result.p99_ms} ms, {result.errors} errors, {result.event_batches} event batches",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
