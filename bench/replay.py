"""Async trace replay against any OpenAI-compatible URL.

Each request is sent as a streaming ``POST /v1/completions`` with a text prompt (the hash ids
expanded to simulator words, so the prompt tokenizes 1:1 and no chat template adds tokens),
``max_tokens`` = the trace's output length and ``stream_options.include_usage`` so the last
chunk reports prompt and cached tokens. Turns of a session are sent in order: a turn goes at
its scheduled time or when the previous turn finished, whichever is later.

The slice replayed is fixed by the trace (requests whose scheduled arrival, divided by the
speed-up, falls within ``max_duration_s``, at most ``max_requests``), so every router in a
comparison sees exactly the same requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import msgspec
from tqdm import tqdm  # type: ignore[import-untyped]

from kvgate.bench.traces import TRACE_BLOCK_TOKENS, TraceRequest, prompt_text

WORKER_HEADERS = ("x-kvgate-worker", "x-sim-replica", "x-sim-worker")
"""Response headers naming the replica that served a request, first found wins."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one trace request."""

    index: int
    session_id: str | None
    scheduled_s: float
    expected_prompt_tokens: int
    max_tokens: int
    sent_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None
    status: str = "not_sent"  # ok | http_<code> | error | cancelled | not_sent
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    target: str
    model: str = "kvgate-sim"
    speedup: float = 1.0
    max_requests: int | None = None
    max_duration_s: float | None = None
    drain_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    block_tokens: int = TRACE_BLOCK_TOKENS  # words per hash id
    send_session: bool = True  # x-session-id header and ``user`` field
    metrics_urls: tuple[str, ...] = ()  # replicas' /metrics to sample during the replay
    metrics_interval_s: float = 1.0
    progress: bool = True


@dataclass(frozen=True, slots=True)
class MetricsSample:
    t: float  # seconds since replay start
    replica: str
    values: dict[str, float]


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    samples: list[MetricsSample] = field(default_factory=list)
    wall_s: float = 0.0
    final_metrics: dict[str, dict[str, float]] = field(default_factory=dict)


def select_slice(requests: Sequence[TraceRequest], cfg: ReplayConfig) -> list[TraceRequest]:
    """The requests a replay sends: bounded by scheduled time and by count."""
    out: list[TraceRequest] = []
    for r in sorted(requests, key=lambda q: (q.arrival_s, q.index)):
        if cfg.max_requests is not None and len(out) >= cfg.max_requests:
            break
        if cfg.max_duration_s is not None and r.arrival_s / cfg.speedup > cfg.max_duration_s:
            break
        out.append(r)
    return out


def session_key(r: TraceRequest) -> str | None:
    """The session a client would name: the trace's session id, else the conversation's first
    block after the shared system prompt (a chat application knows its conversation id)."""
    if r.session_id is not None:
        return r.session_id
    if len(r.hash_ids) > 1:
        return f"conv-{r.hash_ids[1]}"
    return None


def _body(r: TraceRequest, cfg: ReplayConfig) -> dict[str, object]:
    body: dict[str, object] = {
        "model": cfg.model,
        "prompt": prompt_text(r.hash_ids, r.input_length, cfg.block_tokens),
        "max_tokens": r.output_length,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    key = session_key(r) if cfg.send_session else None
    if key is not None:
        body["user"] = key
    return body


def _worker_from(headers: httpx.Headers) -> str | None:
    for name in WORKER_HEADERS:
        value = headers.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def _apply_usage(rec: RequestRecord, usage: dict[str, object]) -> None:
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        rec.prompt_tokens = prompt
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        rec.output_tokens = completion
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if isinstance(cached, int):
            rec.cached_tokens = cached


def _chunk_worker(chunk: dict[str, object]) -> str | None:
    fp = chunk.get("system_fingerprint")
    return fp if isinstance(fp, str) and fp else None


async def _read_stream(resp: httpx.Response, rec: RequestRecord, t0: float) -> None:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if rec.ttft_s is None and '"text"' in data:
            rec.ttft_s = time.perf_counter() - t0
        if "prompt_tokens" in data or rec.worker is None:
            chunk = msgspec.json.decode(data)
            if isinstance(chunk, dict):
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    _apply_usage(rec, usage)
                if rec.worker is None:
                    rec.worker = _chunk_worker(chunk)


def request_id(index: int) -> str:
    """The ``x-request-id`` the trace's request ``index`` carries when replayed, so that a
    router's access log (kvgate's ``request_id``) joins the client's records (``bench tail``)."""
    return f"replay-{index}"


async def send_one(
    client: httpx.AsyncClient,
    r: TraceRequest,
    rec: RequestRecord,
    cfg: ReplayConfig,
    t_start: float,
) -> None:
    """Send one request and fill ``rec`` (never raises for HTTP/transport failures)."""
    headers = {"x-request-id": request_id(r.index)}
    key = session_key(r) if cfg.send_session else None
    if key is not None:
        headers["x-session-id"] = key
    payload = msgspec.json.encode(_body(r, cfg))
    headers["content-type"] = "application/json"
    t0 = time.perf_counter()
    rec.sent_s = t0 - t_start
    try:
        async with client.stream(
            "POST", f"{cfg.target}/v1/completions", content=payload, headers=headers
        ) as resp:
            rec.worker = _worker_from(resp.headers)
            if resp.status_code != 200:
                body = await resp.aread()
                rec.status = f"http_{resp.status_code}"
                rec.error = body[:300].decode(errors="replace")
                return
            await _read_stream(resp, rec, t0)
        rec.e2e_s = time.perf_counter() - t0
        rec.status = "ok" if rec.ttft_s is not None else "error"
        if rec.ttft_s is None:
            rec.error = "stream ended without a token"
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        rec.status = "error"
        rec.error = f"{type(exc).__name__}: {exc}"[:300]


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of each named metric over its label sets (``name`` or ``name{...}`` lines)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


SAMPLED_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "kvgate_sim_busy_seconds_total",
    "kvgate_sim_late_seconds_total",
    "vllm:request_success_total",
)


def metrics_texts(urls: Sequence[str], timeout_s: float = 5.0) -> dict[str, str]:
    """Each server's /metrics text, read now (``url`` -> text; one unreachable or not
    answering 200 is left out)."""
    out: dict[str, str] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for url in urls:
            try:
                resp = client.get(f"{url}/metrics")
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                out[url] = resp.text
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    try:
        resp = await client.get(url, timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text, SAMPLED_METRICS)


async def _sample_loop(
    client: httpx.AsyncClient, cfg: ReplayConfig, t_start: float, out: list[MetricsSample]
) -> None:
    while True:
        t = time.perf_counter() - t_start
        results = await asyncio.gather(*(scrape(client, u) for u in cfg.metrics_urls))
        for url, values in zip(cfg.metrics_urls, results, strict=True):
            if values is not None:
                out.append(MetricsSample(t, url, values))
        await asyncio.sleep(cfg.metrics_interval_s)


def _progress(total: int, enabled: bool) -> Callable[[], None]:
    if not enabled:
        return lambda: None
    bar = tqdm(total=total, unit="req", dynamic_ncols=True, mininterval=1.0)

    def tick() -> None:
        bar.update(1)
        if bar.n >= total:
            bar.close()

    return tick


async def replay(requests: Sequence[TraceRequest], cfg: ReplayConfig) -> ReplayResult:
    """Replay the slice of ``requests`` chosen by ``cfg`` and return one record per request."""
    chosen = select_slice(requests, cfg)
    records = [
        RequestRecord(
            r.index, r.session_id, r.arrival_s / cfg.speedup, r.input_length, r.output_length
        )
        for r in chosen
    ]
    tick = _progress(len(chosen), cfg.progress)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    samples: list[MetricsSample] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_start = time.perf_counter()
        sampler = (
            asyncio.create_task(_sample_loop(client, cfg, t_start, samples))
            if cfg.metrics_urls
            else None
        )
        tasks = await _dispatch(client, chosen, records, cfg, t_start, tick)
        await _drain(tasks, records, cfg.drain_timeout_s)
        wall = time.perf_counter() - t_start
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        final = {}
        for url in cfg.metrics_urls:
            values = await scrape(client, url)
            if values is not None:
                final[url] = values
    return ReplayResult(records, samples, wall, final)


async def _dispatch(
    client: httpx.AsyncClient,
    chosen: Sequence[TraceRequest],
    records: Sequence[RequestRecord],
    cfg: ReplayConfig,
    t_start: float,
    tick: Callable[[], None],
) -> list[asyncio.Task[None]]:
    last_turn: dict[str, asyncio.Task[None]] = {}
    tasks: list[asyncio.Task[None]] = []

    async def run(r: TraceRequest, rec: RequestRecord, after: asyncio.Task[None] | None) -> None:
        try:
            if after is not None and not after.done():
                await asyncio.wait({after})  # the previous turn of this session
            await send_one(client, r, rec, cfg, t_start)
        finally:
            tick()

    for r, rec in zip(chosen, records, strict=True):
        delay = rec.scheduled_s - (time.perf_counter() - t_start)
        if delay > 0:
            await asyncio.sleep(delay)
        prev = last_turn.get(r.session_id) if r.session_id is not None else None
        task = asyncio.create_task(run(r, rec, prev))
        if r.session_id is not None:
            last_turn[r.session_id] = task
        tasks.append(task)
    return tasks


async def _drain(
    tasks: list[asyncio.Task[None]], records: Sequence[RequestRecord], timeout_s: float
) -> None:
    if not tasks:
        return
    _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for rec in records:
        if rec.status == "not_sent":  # never sent, or cut off mid-stream
            rec.status = "cancelled"


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    """One JSON object per request."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(asdict(rec), separators=(",", ":")) + "\n")
