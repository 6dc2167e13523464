"""Event storm: kvgate routing a steady request stream while one extra publisher floods it.

    python -m kvgate.bench.storm [--replicas 2] [--seconds 20] [--rate 8] [--seed 1] [--json PATH]

Two runs side by side, each on a fresh simulated fleet (``replicas`` honest replicas and one
more whose worker's KV events come from the storm publisher instead), a fresh storm publisher
process and a fresh ``kvgate serve`` (kv policy, default bounds), all on 127.0.0.1:

* **quiet**: the extra publisher is connected and silent;
* **storm**: it sends valid, malformed and adversarial payloads (bench/hostile.py: blocks forged
  to carry the honest sessions' keys, self-parented blocks, long chains removed root first,
  repeated keys, deep nesting, huge ranks, colliding hashes, byte mutations, seq jumps and
  restarts, and a replay socket that streams without end) as fast as it can, niced (it stands
  for another machine; on this 2-core box it still takes CPU from everything else). One
  payload every 2 s is larger than kvgate's message bound (ZMQ then drops the connection):
  more often, and the storm would mostly be reconnections.

kvgate runs with ``--index-max-entries 50000`` (``--max-entries``): the storm fills the index
within seconds, so its pruning runs all along (a cap the default 2M reaches later). The load
is steady and bounded: ``rate`` sessions through kvgate and ``rate`` straight to the
honest replicas (the baseline), each sending one growing turn a second (a shared system prompt,
then its own blocks; completions of ``max_tokens`` 1). Reported per run: kvgate's added
latency p50/p99 (kvgate minus direct, per statistic), kvgate's RSS (peak and growth), what the
storm sent and what kvgate refused (its counters), and the honest workers' prediction
accuracy: ``x-kvgate-predicted-cached-tokens`` against the engine's ``cached_tokens``, during
the load and after the storm (one more turn per session once the publisher stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq
import zmq.asyncio

from kvgate.backends.process import LOOPBACK
from kvgate.bench.fleet import (
    SIM_MODEL,
    FleetSpec,
    ManagedProcess,
    bench_port_range,
    kvgate_argv,
    start_fleet,
    wait_own_http,
)
from kvgate.bench.hostile import BLOCK, Attacker, payload, stored
from kvgate.bench.traces import block_words

SYSTEM_BLOCKS = 16  # shared by every session: a branch point with many children
OVERSIZED_BYTES = 2**19  # over this, a payload counts as oversized (kvgate's bound: 1 MiB)
OVERSIZED_EVERY_S = 2.0
TURN_BLOCKS = 2
END_OF_REPLAY = (2**64 - 1).to_bytes(8, "big")


# ------------------------------------------------------------------ prompts
def session_prompt(session: int, turn: int) -> str:
    """The shared system prompt, then ``turn`` turns of the session's own blocks."""
    ids = list(range(1, SYSTEM_BLOCKS + 1)) + [
        100_000 * (session + 1) + j for j in range(TURN_BLOCKS * (turn + 1))
    ]
    return " ".join(word for hid in ids for word in block_words(hid, BLOCK))


# ------------------------------------------------------------------ the storm publisher
def prompt_paths(texts: list[str]) -> tuple[list[list[int]], list[list[int]], int]:
    """Token ids and kvgate keys of the honest prompts, as kvgate computes them."""
    from tokenizers import Tokenizer  # noqa: PLC0415 - only in the publisher process

    from kvgate.backends.sim.tokenizer import tokenizer_dir  # noqa: PLC0415
    from kvgate.index.keys import block_keys, cache_seed  # noqa: PLC0415

    tokenizer = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
    seed = cache_seed(None, None)
    paths = [tokenizer.encode(text, add_special_tokens=True).ids for text in texts]
    return paths, [block_keys(p, BLOCK, seed) for p in paths], seed


def storm_pool(texts: list[str], seed: int, size: int) -> list[bytes]:
    rng = random.Random(seed)
    paths, keys, root_seed = prompt_paths(texts)
    attacker = Attacker(paths, keys, rng, root_seed=root_seed, max_event_blocks=65_536)
    pool = [attacker.next()[1] for _ in range(size)]
    pool += [b"\xc1 garbage", b"", b"\x93\x01\x90\x00", payload([stored([1], None, [1] * 3)])]
    return pool


async def publish(args: argparse.Namespace) -> None:
    """The extra publisher: silent (quiet) or flooding (storm) for ``seconds``, then connected
    and silent until stopped (it prints how many messages it sent)."""
    context = zmq.asyncio.Context()
    pub, router = context.socket(zmq.XPUB), context.socket(zmq.ROUTER)
    for sock, port in ((pub, args.events_port), (router, args.replay_port)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://{LOOPBACK}:{port}")
    texts = json.loads(await asyncio.to_thread(Path(args.prompts).read_text))
    pool = storm_pool(texts, args.seed, 3000)
    # over kvgate's message bound (ZMQ drops the connection): one every OVERSIZED_EVERY_S, so
    # that the storm is mostly payloads kvgate has to read
    oversized = [data for data in pool if len(data) > OVERSIZED_BYTES]
    pool = [data for data in pool if len(data) <= OVERSIZED_BYTES]
    rng = random.Random(args.seed)
    replies = asyncio.create_task(answer_replays(router, pool, rng, args.mode == "storm"))
    sent = 0
    try:
        async with asyncio.timeout(60):
            await pub.recv()  # kvgate subscribed
        deadline = time.monotonic() + args.seconds
        big_at = time.monotonic() + OVERSIZED_EVERY_S
        seq = 0
        while args.mode == "storm" and time.monotonic() < deadline:
            batch = rng.sample(pool, 200)
            if oversized and time.monotonic() > big_at:
                batch.append(rng.choice(oversized))
                big_at += OVERSIZED_EVERY_S
            for data in batch:
                roll = rng.random()
                seq = 0 if roll < 0.002 else seq + (rng.randrange(2, 500) if roll < 0.01 else 1)
                with contextlib.suppress(zmq.Again):
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), data], flags=zmq.NOBLOCK)
                    sent += 1
            await asyncio.sleep(0)
        print(json.dumps({"sent": sent}), flush=True)
        await asyncio.sleep(3600)  # stopped by the benchmark
    finally:
        replies.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await replies
        pub.close(linger=0)
        router.close(linger=0)
        context.term()


async def answer_replays(
    router: zmq.asyncio.Socket, pool: list[bytes], rng: random.Random, hostile: bool
) -> None:
    """Quiet: an empty ring. Storm: replays that end, drip, or never send their end marker."""
    while True:
        identity, _, start = await router.recv_multipart()
        seq = int.from_bytes(start, "big")
        frames = rng.choice([10, 5000, 100_000]) if hostile else 0
        for i in range(frames):
            data = pool[rng.randrange(len(pool))]
            reply = [identity, b"", b"", (seq + i).to_bytes(8, "big"), data]
            with contextlib.suppress(zmq.Again):
                router.send_multipart(reply, flags=zmq.NOBLOCK)
            if i % 100 == 0:
                await asyncio.sleep(0)
        if not hostile or rng.random() < 0.3:
            router.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])


# ------------------------------------------------------------------ the load
@dataclass
class Sample:
    via: str  # kvgate | direct
    session: int
    turn: int
    ms: float
    worker: str | None
    predicted: int | None
    cached: int | None
    ok: bool


@dataclass
class Load:
    samples: list[Sample] = field(default_factory=list)

    async def turn(
        self, client: httpx.AsyncClient, url: str, via: str, session: int, turn: int
    ) -> None:
        body = {"model": SIM_MODEL, "prompt": session_prompt(session, turn), "max_tokens": 1}
        started = time.perf_counter()
        try:
            response = await client.post(f"{url}/v1/completions", json=body)
        except httpx.HTTPError:
            self.samples.append(Sample(via, session, turn, 0.0, None, None, None, False))
            return
        ms = (time.perf_counter() - started) * 1000
        usage: dict[str, Any] = {}
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                usage = response.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        predicted = response.headers.get("x-kvgate-predicted-cached-tokens")
        self.samples.append(
            Sample(
                via,
                session,
                turn,
                ms,
                response.headers.get("x-kvgate-worker"),
                None if predicted is None else int(predicted),
                cached,
                response.status_code == 200,
            )
        )

    async def session(
        self, client: httpx.AsyncClient, url: str, via: str, session: int, *, offset: float,
        seconds: float,
    ) -> None:  # fmt: skip
        """One turn a second (sequential: a late turn delays the next, never overlaps)."""
        start = time.monotonic() + offset
        for turn in range(int(seconds)):
            await asyncio.sleep(max(0.0, start + turn - time.monotonic()))
            await self.turn(client, url, via, session, turn)


async def drive(
    kvgate: str, direct: list[str], rate: int, seconds: float, storm_over: Path
) -> Load:
    """``rate`` sessions through kvgate and as many straight to the replicas; then, once the
    storm is over (its publisher wrote ``storm_over``), one more turn per kvgate session."""
    load = Load()
    limits = httpx.Limits(max_connections=4 * rate + 8)
    async with httpx.AsyncClient(timeout=30.0, limits=limits, trust_env=False) as client:
        for warm_up in range(3):  # the tokenizer's first load, connections: not measured
            await Load().turn(client, kvgate, "warm-up", 999_999, warm_up)
        tasks = []
        for s in range(rate):
            offset = s / rate
            tasks.append(load.session(client, kvgate, "kvgate", s, offset=offset, seconds=seconds))
            tasks.append(load.session(client, direct[s % len(direct)], "direct", 1000 + s,
                                      offset=offset + 0.5 / rate, seconds=seconds))  # fmt: skip
        await asyncio.gather(*tasks)
        async with asyncio.timeout(60):
            while storm_sent(storm_over) < 0:  # noqa: ASYNC110 - a file, nothing to await
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        for s in range(rate):
            await load.turn(client, kvgate, "after", s, int(seconds))
    return load


# ------------------------------------------------------------------ one run
@dataclass
class RunResult:
    mode: str
    kvgate_ms: dict[str, float]
    direct_ms: dict[str, float]
    added_ms: dict[str, float]
    failed_requests: int
    rss_start_mb: float
    rss_peak_mb: float
    storm_sent: int
    accuracy_during: dict[str, int]
    accuracy_after: dict[str, int]
    counters: dict[str, float]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan")}
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def accuracy(samples: list[Sample], honest: set[str]) -> dict[str, int]:
    """Requests answered by honest workers, how many predicted exactly, and the tokens."""
    counted = [s for s in samples if s.ok and s.worker in honest and s.cached is not None]
    return {
        "requests": len(counted),
        "exact": sum(s.predicted == s.cached for s in counted),
        "predicted_tokens": sum(s.predicted or 0 for s in counted),
        "engine_cached_tokens": sum(s.cached or 0 for s in counted),
    }


COUNTERS = (
    "kvgate_index_subscriber_connected",  # 1: its subscriber still alive at the end
    "kvgate_index_decode_errors_total",
    "kvgate_index_failed_batches_total",
    "kvgate_index_limits_total",
    "kvgate_index_resets_total",
    "kvgate_index_subscriber_restarts_total",
    "kvgate_index_skipped_events_total",
)


def scrape_counters(url: str, worker: str) -> dict[str, float]:
    """The index counters of ``worker`` from kvgate's /metrics, summed over other labels."""
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in COUNTERS and f'worker="{worker}"' in line:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def sample_rss(pid: int, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_mb(pid))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.2):
                await stop.wait()


def run_once(mode: str, args: argparse.Namespace, log_dir: Path) -> RunResult:
    spec = FleetSpec(replicas=args.replicas + 1, speedup=args.speedup, block_size=BLOCK)
    fleet = start_fleet(spec, log_dir)
    processes: list[ManagedProcess] = []
    try:
        events_port = bench_port_range(2, start=31000)
        prompts = log_dir / "prompts.json"
        texts = [session_prompt(s, int(args.seconds)) for s in range(args.rate)]
        prompts.write_text(json.dumps(texts))
        storm = ManagedProcess(
            "storm",
            [sys.executable, "-m", "kvgate.bench.storm", "publish", "--mode", mode,
             "--events-port", str(events_port), "--replay-port", str(events_port + 1),
             "--seconds", str(args.seconds + 3), "--seed", str(args.seed),
             "--prompts", str(prompts)],
            log_dir / f"storm-{mode}.log",
        ).start()  # fmt: skip
        processes.append(storm)
        port = bench_port_range(1, start=18500)
        argv = kvgate_argv("serve", "--host", LOOPBACK, "--port", str(port), "--policy", "kv",
                           "--tokenizer", f"{SIM_MODEL}={tokenizer_path()}",
                           "--index-max-entries", str(args.max_entries),
                           "--log-level", "warning")  # fmt: skip
        urls = fleet.urls
        for url, events, replay in zip(
            urls[:-1], fleet.event_endpoints, fleet.replay_endpoints, strict=False
        ):
            argv += ["--worker", f"{url},models={SIM_MODEL},events={events},replay={replay}"]
        hostile_events = f"tcp://{LOOPBACK}:{events_port}"
        hostile_replay = f"tcp://{LOOPBACK}:{events_port + 1}"
        argv += ["--worker", f"{urls[-1]},models={SIM_MODEL},events={hostile_events},"
                 f"replay={hostile_replay}"]  # fmt: skip
        kvgate = ManagedProcess(f"kvgate-{mode}", argv, log_dir / f"kvgate-{mode}.log").start()
        processes.append(kvgate)
        url = f"http://{LOOPBACK}:{port}"
        wait_own_http(f"{url}/ready", 60.0, kvgate)
        time.sleep(1.0)  # let the subscriptions settle (and the storm begin)
        rss_start = rss_mb(kvgate.pid)
        peak = [rss_start]

        async def measured() -> Load:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(kvgate.pid, peak, stop))
            try:
                storm_log = log_dir / f"storm-{mode}.log"
                return await drive(url, urls[:-1], args.rate, args.seconds, storm_log)
            finally:
                stop.set()
                await sampler

        load = asyncio.run(measured())
        counters = scrape_counters(url, urls[-1])
        sent = storm_sent(log_dir / f"storm-{mode}.log")
        kv = [s.ms for s in load.samples if s.via == "kvgate" and s.ok]
        direct = [s.ms for s in load.samples if s.via == "direct" and s.ok]
        kv_q, direct_q = quantiles(kv), quantiles(direct)
        honest = set(urls[:-1])
        return RunResult(
            mode=mode,
            kvgate_ms=kv_q,
            direct_ms=direct_q,
            added_ms={k: kv_q[k] - direct_q[k] for k in kv_q},
            failed_requests=sum(not s.ok for s in load.samples),
            rss_start_mb=rss_start,
            rss_peak_mb=peak[0],
            storm_sent=sent,
            accuracy_during=accuracy([s for s in load.samples if s.via == "kvgate"], honest),
            accuracy_after=accuracy([s for s in load.samples if s.via == "after"], honest),
            counters=counters,
        )
    finally:
        for process in reversed(processes):
            process.stop()
        fleet.stop()


def storm_sent(log: Path) -> int:
    """Messages the storm publisher sent (the line it logs when its flood ends)."""
    for line in reversed(log.read_text().splitlines() if log.exists() else []):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(line)["sent"])
    return -1


def tokenizer_path() -> Path:
    from kvgate.backends.sim.tokenizer import tokenizer_dir  # noqa: PLC0415

    return tokenizer_dir()


# ------------------------------------------------------------------ report
def report(results: list[RunResult]) -> str:
    lines = [
        "| run | added p50 ms | added p99 ms | kvgate p50/p99 ms | direct p50/p99 ms "
        "| RSS start → peak MiB | storm msgs | honest exact (during) | honest exact (after) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        during, after = r.accuracy_during, r.accuracy_after
        lines.append(
            f"| {r.mode} | {r.added_ms['p50']:.2f} | {r.added_ms['p99']:.2f} "
            f"| {r.kvgate_ms['p50']:.2f} / {r.kvgate_ms['p99']:.2f} "
            f"| {r.direct_ms['p50']:.2f} / {r.direct_ms['p99']:.2f} "
            f"| {r.rss_start_mb:.0f} → {r.rss_peak_mb:.0f} | {r.storm_sent:,} "
            f"| {during['exact']}/{during['requests']} | {after['exact']}/{after['requests']} |"
        )
    for r in results:
        if r.counters:
            shown = ", ".join(
                f"{k.removeprefix('kvgate_index_')} {v:g}" for k, v in r.counters.items()
            )
            lines.append(f"\n{r.mode}: hostile worker's counters: {shown}")
    return "\n".join(lines)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    pub = sub.add_parser("publish", help="(internal) the storm publisher process")
    pub.add_argument("--mode", choices=["quiet", "storm"], required=True)
    pub.add_argument("--events-port", type=int, required=True)
    pub.add_argument("--replay-port", type=int, required=True)
    pub.add_argument("--seconds", type=float, required=True)
    pub.add_argument("--seed", type=int, default=1)
    pub.add_argument("--prompts", required=True)
    parser.add_argument("--replicas", type=int, default=2, help="honest replicas")
    parser.add_argument("--seconds", type=float, default=20.0, help="load per run")
    parser.add_argument("--rate", type=int, default=8, help="sessions per side, 1 turn/s each")
    parser.add_argument("--speedup", type=float, default=20.0, help="simulator speed-up")
    parser.add_argument(
        "--max-entries",
        type=int,
        default=50_000,
        help="kvgate's --index-max-entries: small, so that the storm fills it and it prunes",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.command == "publish":
        os.nice(19)  # another machine, in production
        asyncio.run(publish(args))
        return 0
    print(f"load average before: {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvgate-storm-") as tmp:
        results = [run_once(mode, args, Path(tmp) / mode) for mode in ("quiet", "storm")]
    print(report(results))
    print(f"load average after: {load_average()}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
