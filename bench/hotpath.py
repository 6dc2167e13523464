"""Router hot path micro-benchmark: the CPU one routing decision costs, stage by stage.

    python -m kvgate.bench.hotpath [--scale 1.0] [--rounds 3] [--cases short,...] [--json PATH]

In-process, no HTTP and no profiler: ``Router.decide`` (the scheduler's routing: keys,
match, the policy's ranking and the capacity rule) end to end against a
``KvIndexService`` loaded with the simulator's tokenizer (``backends.sim.tokenizer``) and an
event index holding chains for 8 workers (the request's own prefix on some of them, plus
background chains), with the ``kv`` policy. Cases:

* ``short``: a chat of about 30 tokens (shared system line, a fresh user line each time);
* ``chat2k``: a 2k-token chat (a shared 1.5k-token system prompt, a fresh 500-token question);
* ``agent50k``: a 50k-token agent turn with tools, warm (the history was routed before;
  each request adds a fresh user turn);
* ``completion``: ``/v1/completions`` with a fresh 500-token text prompt;
* ``token_ids``: ``/v1/completions`` with a fresh 2k-token list of token ids;
* ``text40k_new`` / ``text40k_repeat`` / ``text40k_grow``: ``/v1/completions`` with a long
  plain-text prompt (agent histories and trace replays re-send theirs every turn): a fresh
  40k-word text each time; the same 40k-word text each time; a 40k-word text growing by 500
  fresh words per request (each request's prompt extends the previous one; every pass starts
  again from the same 40k-word base, so prompts stay within 40k-45k words);
* ``text20k_tool``: a 20k-word text growing by 10k fresh words per request (an agent turn
  that adds a long tool output; every pass starts again from the 20k-word base);
* ``short_rr``: the short chat with ``round_robin`` and no index (the proxy path's decide).

Every request is different (no exact-text reuse), as in real traffic. Per case, two passes
over fresh requests: a clean one (``decide`` wall time per call, and the process CPU time of
the whole pass divided by the calls), then an instrumented one that times each stage through
thin wrappers: ``parse`` (body bytes -> ``PromptInput``: msgspec + pydantic), ``render``
(chat template), ``tokenize`` (tokenizer with the prefix cache, and block keys), ``keys``
(``keys_for`` end to end), ``match`` (index lookup), ``rank`` (policy), each in wall time
and in process CPU time (a CPU-clock read costs about 1-2 µs: small stages are inflated).
Figures are medians and p99 in microseconds; ``--rounds`` repeats the clean pass and reports
the median of the rounds' medians. The clean pass also gives each call's process CPU (mean
and p99) and, when the tokenizer finishes long new prompts in the background
(``ModelTokenizer.drain``), waits for that work after each call and reports its CPU apart
("background"): it is off the request path. The machine is shared: compare interleaved runs (CPU
figures are the steadier), pin with ``taskset -c N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from kvgate.backends.config import WorkerConfig
from kvgate.backends.registry import WorkerRegistry
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.backends.sim.vocab import generated_word
from kvgate.index.api import PromptInput, StoreBlocks
from kvgate.index.config import IndexConfig
from kvgate.index.keys import ModelTokenizer
from kvgate.index.service import KvIndexService
from kvgate.index.types import BlockKey, WorkerId, WorkerKey
from kvgate.router.requests import ChatBody, CompletionBody, decode_json_object, validate
from kvgate.scheduling.ledger import Ledger
from kvgate.scheduling.routing import Router
from kvgate.scoring.api import Policy
from kvgate.scoring.policies import make_policy

MODEL = "bench-model"
WORKERS = 8
NOISE_CHAINS = 400
NOISE_CHAIN_BLOCKS = 250  # 400 chains x 250 blocks, each held by 2 workers: 200k entries

Samples = dict[str, list[int]]  # stage -> nanoseconds per call


# --------------------------------------------------------------------------- requests


class Words:
    """Random single-token words of the simulator's vocabulary (seeded)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._word = generated_word

    def text(self, count: int) -> str:
        rng, word = self._rng, self._word
        return " ".join(word(rng.randrange(20_000)) for _ in range(count))


def _tools(words: Words, count: int) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": words.text(40),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": words.text(12)},
                        "limit": {"type": "integer", "description": words.text(8)},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(count)
    ]


@dataclass
class Case:
    name: str
    endpoint: str  # "chat" | "completion"
    make: Callable[[int], dict[str, Any]]  # request number -> body
    calls: int
    policy: str = "kv"
    indexed: bool = True


def make_cases(rng: random.Random, scale: float) -> list[Case]:
    words = Words(rng)
    short_system = {"role": "system", "content": "You are a helpful assistant."}
    system_2k = {"role": "system", "content": words.text(1500)}
    history: list[dict[str, Any]] = [{"role": "system", "content": words.text(2000)}]
    while sum(len(str(m["content"]).split()) for m in history) < 48_000:
        history.append({"role": "user", "content": words.text(400)})
        history.append({"role": "assistant", "content": words.text(600)})
    tools = _tools(words, 6)
    long_text = words.text(40_000)

    def growing(base: str, step_words: int) -> Callable[[int], dict[str, Any]]:
        """Request i: ``base`` plus i + 1 steps of fresh words (from ``base`` again at i 0)."""
        prompt = [base]

        def grown(i: int) -> dict[str, Any]:
            if i == 0:
                prompt[0] = base
            prompt[0] += " " + words.text(step_words)
            return {"model": MODEL, "prompt": prompt[0], "max_tokens": 16}

        return grown

    def n(calls: int) -> int:
        return max(5, round(calls * scale))

    def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": messages, "max_tokens": 64, **extra}

    return [
        Case(
            "short",
            "chat",
            lambda i: chat([short_system, {"role": "user", "content": words.text(20)}]),
            n(600),
        ),
        Case(
            "chat2k",
            "chat",
            lambda i: chat([system_2k, {"role": "user", "content": words.text(500)}]),
            n(300),
        ),
        Case(
            "agent50k",
            "chat",
            lambda i: chat([*history, {"role": "user", "content": words.text(150)}], tools=tools),
            n(40),
        ),
        Case(
            "completion",
            "completion",
            lambda i: {"model": MODEL, "prompt": words.text(500), "max_tokens": 16},
            n(300),
        ),
        Case(
            "token_ids",
            "completion",
            lambda i: {
                "model": MODEL,
                "prompt": [rng.randrange(30_000) for _ in range(2048)],
                "max_tokens": 16,
            },
            n(300),
        ),
        Case(
            "text40k_new",
            "completion",
            lambda i: {"model": MODEL, "prompt": words.text(40_000), "max_tokens": 16},
            n(6),
        ),
        Case(
            "text40k_repeat",
            "completion",
            lambda i: {"model": MODEL, "prompt": long_text, "max_tokens": 16},
            n(10),
        ),
        Case("text40k_grow", "completion", growing(long_text, 500), n(10)),
        # a tool's long output per turn
        Case("text20k_tool", "completion", growing(words.text(20_000), 10_000), n(10)),
        Case(
            "short_rr",
            "chat",
            lambda i: chat([short_system, {"role": "user", "content": words.text(20)}]),
            n(600),
            policy="round_robin",
            indexed=False,
        ),
    ]


# --------------------------------------------------------------------------- timing shims


class StageClock:
    """Collects wall and process CPU nanoseconds per named stage."""

    def __init__(self) -> None:
        self.wall: Samples = defaultdict(list)
        self.cpu: Samples = defaultdict(list)

    def _recorders(self, stage: str) -> tuple[Callable[[int], None], Callable[[int], None]]:
        return self.wall[stage].append, self.cpu[stage].append

    def sync(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        wall, cpu = self._recorders(stage)
        now, cpu_now = time.perf_counter_ns, time.process_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            cpu_started, started = cpu_now(), now()
            try:
                return fn(*args, **kwargs)
            finally:
                wall(now() - started)
                cpu(cpu_now() - cpu_started)

        return timed

    def coro(self, stage: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        wall, cpu = self._recorders(stage)
        now, cpu_now = time.perf_counter_ns, time.process_time_ns

        async def timed(*args: Any, **kwargs: Any) -> Any:
            cpu_started, started = cpu_now(), now()
            try:
                return await fn(*args, **kwargs)
            finally:
                wall(now() - started)
                cpu(cpu_now() - cpu_started)

        return timed


class TimedIndex:
    """A ``BlockIndex`` that times ``keys_for`` and ``match`` of the real one."""

    def __init__(self, inner: Any, clock: StageClock) -> None:
        self.keys_for = clock.coro("keys", inner.keys_for)
        self.match = clock.sync("match", inner.match)
        self.record_routed = inner.record_routed


class TimedPolicy:
    def __init__(self, inner: Any, clock: StageClock) -> None:
        self.name = inner.name
        self.rank = clock.sync("rank", inner.rank)


# --------------------------------------------------------------------------- set-up


@dataclass
class Bench:
    service: KvIndexService
    registry: WorkerRegistry
    ledger: Ledger
    policies: dict[str, Policy]
    tokenizer: ModelTokenizer
    http: httpx.AsyncClient
    rng: random.Random

    @classmethod
    async def create(cls, rng: random.Random) -> Bench:
        http = httpx.AsyncClient(trust_env=False)
        config = IndexConfig(tokenizers={MODEL: tokenizer_dir()}, engine_tokenize=False)
        service = KvIndexService(config, CollectorRegistry(), http)
        registry = WorkerRegistry()
        ledger = Ledger(registry)
        for port in range(9001, 9001 + WORKERS):
            worker = registry.add(
                WorkerConfig(url=f"http://127.0.0.1:{port}", engine="vllm", models=[MODEL])
            )
            worker.healthy = True
            sent = ledger.of(worker)
            sent.in_flight = rng.randrange(4)
            sent.pending_prefill_tokens = rng.randrange(4000)
            sent.active_decode_blocks = rng.randrange(400)
        policies = {
            "kv": make_policy("kv", seed=1),
            "round_robin": make_policy("round_robin", seed=1),
        }
        tokenizer = await service._keyer._tokenizer(MODEL)  # bench-only: the loaded tokenizer
        if tokenizer is None:
            raise RuntimeError("the simulator tokenizer did not load")
        bench = cls(service, registry, ledger, policies, tokenizer, http, rng)
        bench.add_noise()
        return bench

    def worker_ids(self) -> list[WorkerId]:
        return [w.id for w in self.registry]

    def add_noise(self) -> None:
        ids = self.worker_ids()
        rand = self.rng.getrandbits
        for chain in range(NOISE_CHAINS):
            keys = [BlockKey(rand(64)) for _ in range(NOISE_CHAIN_BLOCKS)]
            for holder in (ids[chain % WORKERS], ids[(chain + 1) % WORKERS]):
                self.service.events.apply(WorkerKey(holder, 0), StoreBlocks(keys))

    def hold(self, keys: Sequence[BlockKey]) -> None:
        """Spread a request's prefix over the workers: two hold it all, one half, two a
        tenth, three nothing."""
        n = len(keys)
        shares = [n, n // 2, n // 10, n // 10, 0, 0, n, 0]
        for worker, share in zip(self.worker_ids(), shares, strict=True):
            if share:
                self.service.events.apply(WorkerKey(worker, 0), StoreBlocks(list(keys[:share])))

    async def aclose(self) -> None:
        await self.http.aclose()


async def run_case(bench: Bench, case: Case, rounds: int) -> dict[str, Any]:
    body_type: type[ChatBody | CompletionBody] = (
        ChatBody if case.endpoint == "chat" else CompletionBody
    )

    def parse(raw: bytes) -> tuple[PromptInput, int | None]:
        parsed = validate(body_type, decode_json_object(raw))
        return parsed.prompt_input(), parsed.output_limit

    def bodies(count: int) -> list[bytes]:
        return [json.dumps(case.make(i)).encode() for i in range(count)]

    policy = bench.policies[case.policy]
    index = bench.service if case.indexed else None
    plain = Router(bench.registry, bench.ledger, policy, index)

    # Warm-up: the tokenizer, the prefix cache (the "previous turn"), and the index.
    for raw in bodies(5):
        prompt, _ = parse(raw)
        routed = await plain.decide(MODEL, prompt)
        routed.finish_keys()  # what the proxy does when the answer begins
        if case.indexed and routed.keys is not None:
            bench.hold(routed.keys.block_keys)

    clean_medians: list[float] = []
    clean_p99s: list[float] = []
    cpu_per_call: list[float] = []
    cpu_p99s: list[float] = []
    background_per_call: list[float] = []
    drain = getattr(bench.tokenizer, "drain", None)  # background tokenization, if any
    for _ in range(rounds):
        prompts = [parse(raw) for raw in bodies(case.calls)]
        wall: list[int] = []
        cpu: list[int] = []
        background = 0
        now, cpu_now = time.perf_counter_ns, time.process_time_ns
        for prompt, limit in prompts:
            started, cpu_started = now(), cpu_now()
            routed = await plain.decide(MODEL, prompt, max_tokens=limit)
            wall.append(now() - started)
            cpu.append(cpu_now() - cpu_started)
            routed.finish_keys()  # what the proxy does when the answer begins
            if drain is not None:  # off the request path: counted apart, not in the next call
                cpu_started = cpu_now()
                await drain()
                background += cpu_now() - cpu_started
        cpu_per_call.append(sum(cpu) / len(prompts) / 1e3)
        cpu_p99s.append(_p99(cpu) / 1e3)
        background_per_call.append(background / len(prompts) / 1e3)
        clean_medians.append(statistics.median(wall) / 1e3)
        clean_p99s.append(_p99(wall) / 1e3)

    clock = StageClock()
    timed_index = TimedIndex(bench.service, clock) if case.indexed else None
    timed = Router(bench.registry, bench.ledger, TimedPolicy(policy, clock), timed_index)
    tokenizer = bench.tokenizer  # timed through instance attributes, removed afterwards
    setattr(tokenizer, "render", clock.sync("render", tokenizer.render))  # noqa: B010
    setattr(tokenizer, "tokenize", clock.coro("tokenize", tokenizer.tokenize))  # noqa: B010
    timed_parse = clock.sync("parse", parse)
    try:
        for raw in bodies(case.calls):
            prompt, limit = timed_parse(raw)
            (await timed.decide(MODEL, prompt, max_tokens=limit)).finish_keys()
            if drain is not None:  # background work is not any stage's
                await drain()
    finally:
        del tokenizer.render, tokenizer.tokenize
    return {
        "calls": case.calls,
        "policy": case.policy,
        "decide_median_us": statistics.median(clean_medians),
        "decide_p99_us": statistics.median(clean_p99s),
        "decide_cpu_us": statistics.median(cpu_per_call),
        "decide_cpu_p99_us": statistics.median(cpu_p99s),
        "background_cpu_us": statistics.median(background_per_call),
        "stages": _stage_stats(clock.wall),
        "stages_cpu": _stage_stats(clock.cpu),
    }


def _stage_stats(samples: Samples) -> dict[str, dict[str, float]]:
    return {
        stage: {"median_us": statistics.median(ns) / 1e3, "p99_us": _p99(ns) / 1e3}
        for stage, ns in samples.items()
        if ns
    }


def _p99(samples: Sequence[int]) -> float:
    ordered = sorted(samples)
    return float(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))])


# --------------------------------------------------------------------------- report

STAGES = ("parse", "render", "tokenize", "keys", "match", "rank")


def markdown(results: Mapping[str, Mapping[str, Any]]) -> str:
    head = "| case | decide p50 / p99 (µs) | decide CPU mean / p99 (µs) | background CPU (µs) | "
    lines = []
    for key, what in (("stages", "wall"), ("stages_cpu", "process CPU")):
        lines += [
            f"Stages, {what} (µs, p50 / p99):",
            "",
            head + " | ".join(STAGES) + " |",
            "|---" * (4 + len(STAGES)) + "|",
        ]
        for name, r in results.items():
            cells = []
            for stage in STAGES:
                s = r[key].get(stage)
                cells.append(f"{s['median_us']:.0f} / {s['p99_us']:.0f}" if s else "-")
            lines.append(
                f"| {name} | {r['decide_median_us']:.0f} / {r['decide_p99_us']:.0f} | "
                f"{r['decide_cpu_us']:.0f} / {r.get('decide_cpu_p99_us', 0):.0f} | "
                f"{r.get('background_cpu_us', 0):.0f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


async def run(names: Sequence[str] | None, scale: float, rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    bench = await Bench.create(rng)
    results: dict[str, Any] = {}
    try:
        for case in make_cases(rng, scale):
            if names and case.name not in names:
                continue
            results[case.name] = await run_case(bench, case, rounds)
    finally:
        await bench.aclose()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvgate.bench.hotpath",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every call count")
    parser.add_argument("--rounds", type=int, default=3, help="clean passes per case")
    parser.add_argument("--cases", help="comma-separated subset of the cases")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    names = ns.cases.split(",") if ns.cases else None
    try:
        import uvloop  # noqa: PLC0415

        results = uvloop.run(run(names, ns.scale, ns.rounds, ns.seed))
    except ImportError:
        results = asyncio.run(run(names, ns.scale, ns.rounds, ns.seed))
    print(markdown(results))
    if ns.json is not None:
        ns.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
