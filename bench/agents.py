"""Closed-loop agent sessions against one or more gateways, one record per request.

``slots`` sessions run at once; each sends its turns one after the other (a turn after the
previous one ended and a think time), and when it is done a new session takes its slot. A
session's prompt is a shared system prompt and tool catalogue, then its own history growing
by a few blocks a turn; most think times are short, some are long tool calls, so idle
sessions come back to caches that may have evicted their tails. Requests are streaming
``POST /v1/completions`` with a text prompt of simulator words (one word, one token) and
``stream_options.include_usage``, so each answer reports prompt and cached tokens.

The client behaves like the OpenAI SDK: a request that gets no response at all (connection
refused, or closed before any response byte) is retried up to ``client_retries`` times, after
0.5 s doubling (x0.75..1 jitter), or at once on the next gateway when there are several
(a load balancer). Nothing else is retried: an HTTP error or a stream without a token is a
failure before any token, a stream that broke or ended in an error after tokens is cut.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

import httpx
import msgspec

from kvgate.bench.traces import block_words

MODEL = "kvgate-sim"
_SESSION_BLOCKS = 10_000  # block ids of session k: 10,000 (k + 1) onwards


@dataclass(frozen=True, slots=True)
class AgentLoad:
    """The shape of the load (every count and size bounded)."""

    slots: int = 24  # sessions running at once
    max_turns: int = 10
    block_words: int = 64  # words (= tokens) per prompt block
    system_blocks: int = 8  # shared system prompt and tool catalogue
    first_blocks: int = 4  # a session's own first message
    growth_blocks: tuple[int, int] = (1, 3)  # blocks a turn adds (min, max)
    output_tokens: tuple[int, int] = (8, 24)
    think_s: float = 0.5  # mean of the short think times (exponential)
    tool_share: float = 0.2  # share of turns followed by a long tool call instead
    tool_s: tuple[float, float] = (4.0, 12.0)  # its duration (uniform)
    client_retries: int = 2  # as the OpenAI SDK's max_retries
    request_timeout_s: float = 60.0
    seed: int = 0


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times in seconds from the start of the run."""

    session: str
    turn: int
    sent_s: float  # first attempt
    prompt_words: int
    reusable: int = 0  # prompt tokens sent before (the previous turn's prompt; turn 0: system)
    status: str = "failed"  # ok | failed (no token) | cut (tokens, then an error) | cancelled
    gateway: int = -1  # which gateway answered
    http_status: int | None = None
    ttft_s: float | None = None  # from the first attempt to the first token
    end_s: float | None = None
    tokens: int = 0
    predicted: int = 0  # x-kvgate-predicted-cached-tokens
    prompt_tokens: int = 0  # the engine's usage
    cached_tokens: int | None = None
    worker: str | None = None
    client_retries: int = 0
    error: str | None = None


@dataclass(slots=True)
class _Stream:
    """What reading one SSE answer found."""

    tokens: int = 0
    done: bool = False
    error: str | None = None
    first_token_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None


class Gateways:
    """The gateways the load is spread over (round robin), and their retry order."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self._turn = count()

    def pick(self) -> int:
        return next(self._turn) % len(self.urls)


def session_words(history: Sequence[int], load: AgentLoad) -> str:
    return " ".join(word for hid in history for word in block_words(hid, load.block_words))


def _apply_usage(found: _Stream, usage: dict[str, object]) -> None:
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        found.prompt_tokens = prompt
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        found.cached_tokens = details["cached_tokens"]


def _read_event(found: _Stream, payload: str) -> None:
    if payload == "[DONE]":
        found.done = True
        return
    event = msgspec.json.decode(payload)
    if not isinstance(event, dict):
        return
    if event.get("error") is not None:
        found.error = str(event["error"])[:200]
        return
    for choice in event.get("choices") or []:
        if isinstance(choice, dict) and choice.get("text"):
            found.tokens += 1
            if found.first_token_at is None:
                found.first_token_at = time.perf_counter()
    usage = event.get("usage")
    if isinstance(usage, dict):
        _apply_usage(found, usage)


async def _read_stream(resp: httpx.Response, found: _Stream) -> None:
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            _read_event(found, line[5:].strip())
            if found.done:
                return


class AgentRun:
    """Runs the sessions until ``duration_s`` and keeps every request's record."""

    def __init__(self, gateways: Gateways, load: AgentLoad, duration_s: float) -> None:
        self.gateways = gateways
        self.load = load
        self.duration_s = duration_s
        self.records: list[Record] = []
        self.t0 = 0.0
        self.jitter = random.Random(f"{load.seed}:jitter")
        self.started = asyncio.Event()
        self._sessions = count()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self, drain_s: float) -> None:
        """Sessions start turns until ``duration_s``; the turns then in flight get
        ``drain_s`` more to finish, and are cancelled (status ``cancelled``) after."""
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        timeout = httpx.Timeout(self.load.request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            self.t0 = time.perf_counter()
            self.started.set()
            slots = [asyncio.create_task(self._slot(client)) for _ in range(self.load.slots)]
            _, late = await asyncio.wait(slots, timeout=self.duration_s + drain_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*slots, return_exceptions=True)

    async def _slot(self, client: httpx.AsyncClient) -> None:
        while self.now() < self.duration_s:
            await self._session(client, next(self._sessions))

    async def _session(self, client: httpx.AsyncClient, number: int) -> None:
        """One session: its own seeded choices and block ids, whatever the timing."""
        load = self.load
        rng = random.Random(f"{load.seed}:{number}")
        sid = f"s{number:05d}"
        own = iter(range(_SESSION_BLOCKS * (number + 1), _SESSION_BLOCKS * (number + 2)))
        history = list(range(load.system_blocks))
        history += [next(own) for _ in range(load.first_blocks)]
        reusable = load.system_blocks * load.block_words
        for turn in range(load.max_turns):
            if self.now() >= self.duration_s:
                return
            tokens = rng.randint(*load.output_tokens)
            await self._turn(client, sid, turn, history, tokens, reusable)
            reusable = len(history) * load.block_words
            history += [next(own) for _ in range(rng.randint(*load.growth_blocks))]
            if rng.random() < load.tool_share:
                pause = rng.uniform(*load.tool_s)
            else:
                pause = rng.expovariate(1.0 / load.think_s)
            # the draw is made either way (the session's choices do not depend on timing);
            # no turn starts after the duration, so no pause waits past it
            await asyncio.sleep(min(pause, max(0.0, self.duration_s - self.now())))

    async def _turn(
        self,
        client: httpx.AsyncClient,
        sid: str,
        turn: int,
        history: list[int],
        max_tokens: int,
        reusable: int,
    ) -> None:
        prompt = session_words(history, self.load)
        body = msgspec.json.encode(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "user": sid,
            }
        )
        rec = Record(sid, turn, self.now(), len(history) * self.load.block_words, reusable)
        self.records.append(rec)
        try:
            await send(client, self.gateways, body, rec, self)
        except asyncio.CancelledError:
            rec.status = "cancelled"  # still running when the drain ended
            raise
        finally:
            rec.end_s = self.now()


async def send(
    client: httpx.AsyncClient, gateways: Gateways, body: bytes, rec: Record, run: AgentRun
) -> None:
    """Send one request as an SDK client would, filling ``rec`` (never raises)."""
    headers = {"content-type": "application/json", "x-session-id": rec.session}
    started = time.perf_counter()
    target = gateways.pick()
    for attempt in range(1 + run.load.client_retries):
        rec.gateway = target
        found = _Stream()
        responded = False
        try:
            url = gateways.urls[target] + "/v1/completions"
            async with client.stream("POST", url, content=body, headers=headers) as resp:
                responded = True
                _take_response(rec, resp)
                if resp.status_code != 200:
                    rec.error = (await resp.aread())[:300].decode(errors="replace")
                    return
                await _read_stream(resp, found)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            found.error = found.error or f"{type(exc).__name__}: {exc}"[:200]
            if not responded and attempt < run.load.client_retries:
                rec.client_retries += 1
                target = await _before_retry(gateways, target, attempt, run)
                continue
        _finish(rec, found, started)
        return


def _take_response(rec: Record, resp: httpx.Response) -> None:
    rec.http_status = resp.status_code
    rec.worker = resp.headers.get("x-kvgate-worker")
    predicted = resp.headers.get("x-kvgate-predicted-cached-tokens")
    rec.predicted = int(predicted) if predicted and predicted.isdigit() else 0


async def _before_retry(gateways: Gateways, target: int, attempt: int, run: AgentRun) -> int:
    """The next gateway at once when there are several, else the SDK's backoff."""
    if len(gateways.urls) > 1:
        return (target + 1) % len(gateways.urls)
    await asyncio.sleep(min(0.5 * 2**attempt, 8.0) * (1 - 0.25 * run.jitter.random()))
    return target


def _finish(rec: Record, found: _Stream, started: float) -> None:
    rec.tokens = found.tokens
    rec.prompt_tokens = found.prompt_tokens
    rec.cached_tokens = found.cached_tokens
    rec.error = found.error
    if found.first_token_at is not None:
        rec.ttft_s = found.first_token_at - started
    if found.tokens == 0:
        rec.status = "failed"
    elif found.done and found.error is None:
        rec.status = "ok"
    else:
        rec.status = "cut"


@dataclass(slots=True)
class Tally:
    """Counts and token sums over a set of records."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    cut: int = 0
    cancelled: int = 0  # still running when the run's drain ended (not judged)
    client_retries: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reusable: int = 0  # prompt tokens that had been sent before
    predicted: int = 0
    phantom: int = 0  # predicted cached tokens the engine did not report cached
    ttfts: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, records: Sequence[Record]) -> Tally:
        tally = cls()
        for rec in records:
            tally.add(rec)
        return tally

    def add(self, rec: Record) -> None:
        self.sent += 1
        self.client_retries += rec.client_retries
        if rec.status == "cut":
            self.cut += 1
        elif rec.status == "failed":
            self.failed += 1
        elif rec.status == "cancelled":
            self.cancelled += 1
        if rec.status != "ok" or rec.cached_tokens is None:
            return
        self.ok += 1
        self.prompt_tokens += rec.prompt_tokens
        self.cached_tokens += rec.cached_tokens
        self.reusable += rec.reusable
        self.predicted += rec.predicted
        self.phantom += max(0, rec.predicted - rec.cached_tokens)
        if rec.ttft_s is not None:
            self.ttfts.append(rec.ttft_s)

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def reuse_rate(self) -> float | None:
        """Cached tokens over the tokens that could have been: the hit rate without the
        swings of the session mix (a window of new sessions has little to reuse)."""
        return self.cached_tokens / self.reusable if self.reusable else None

    @property
    def phantom_share(self) -> float:
        return self.phantom / self.predicted if self.predicted else 0.0
