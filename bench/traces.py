"""Workload traces: loaders for Mooncake JSONL and agentic sessions, a synthetic generator,
and the deterministic expansion of hash ids into prompt text.

A trace is a list of ``TraceRequest`` sorted by ``arrival_s`` (seconds from the start of the
replay, before any speed-up). Requests of one session carry the same ``session_id`` and are
replayed in order (a turn is never sent before the previous turn of its session finished).
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

import xxhash

from kvgate.backends.sim.vocab import GENERATED_WORDS, generated_word

TRACE_BLOCK_TOKENS = 512
"""Tokens per trace hash id (Mooncake and agentic traces both use 512)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class AgenticReplayOptions:
    """How agentic sessions are laid out in time."""

    session_rate: float = 0.5  # sessions started per second (Poisson)
    max_gap_s: float = 30.0  # idle gaps between turns are capped to this
    max_sessions: int | None = None
    seed: int = 0
    skip_sessions: int = 0  # drop the trace's first N sessions (a held-out slice)


def _open_text(path: Path) -> Iterator[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            yield from fh
    else:
        with path.open(encoding="utf-8") as fh:
            yield from fh


def read_jsonl(path: Path) -> Iterator[dict[str, object]]:
    """Yield each JSON object of a (possibly gzip-compressed) JSON-lines file."""
    for line in _open_text(path):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"{path}: expected one JSON object per line")
            yield row


def _ints(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError(f"trace field {name!r} must be a list of integers")
    return tuple(value)


def _int(row: dict[str, object], name: str) -> int:
    value = row.get(name)
    if not isinstance(value, int | float):
        raise ValueError(f"trace field {name!r} must be a number, got {value!r}")
    return int(value)


def load_mooncake(path: Path, limit: int | None = None, skip: int = 0) -> list[TraceRequest]:
    """Mooncake JSONL: ``timestamp`` (ms from trace start), lengths and ``hash_ids``.

    ``skip`` requests are dropped from the start and arrivals are re-based so the first kept
    request arrives at 0.
    """
    out: list[TraceRequest] = []
    base: float | None = None
    for n, row in enumerate(read_jsonl(path)):
        if n < skip:
            continue
        if limit is not None and len(out) >= limit:
            break
        ts = _int(row, "timestamp") / 1000.0
        base = ts if base is None else base
        out.append(
            TraceRequest(
                index=len(out),
                arrival_s=ts - base,
                input_length=_int(row, "input_length"),
                output_length=max(1, _int(row, "output_length")),
                hash_ids=_ints(row.get("hash_ids"), "hash_ids"),
            )
        )
    return out


@dataclass(slots=True)
class _Session:
    session_id: str
    turns: list[dict[str, object]] = field(default_factory=list)


def _group_sessions(rows: Iterable[dict[str, object]]) -> list[_Session]:
    sessions: dict[str, _Session] = {}
    for row in rows:
        sid = str(row.get("session_id"))
        sessions.setdefault(sid, _Session(sid)).turns.append(row)
    return list(sessions.values())


def layout_sessions(
    sessions: Sequence[Sequence[tuple[float, int, int, tuple[int, ...]]]],
    session_ids: Sequence[str],
    options: AgenticReplayOptions,
) -> list[TraceRequest]:
    """Place sessions in time: Poisson starts, turn gaps kept (capped at ``max_gap_s``).

    Each session is a sequence of ``(offset_s, input_length, output_length, hash_ids)``
    with offsets from the session's own start.
    """
    rng = random.Random(options.seed)
    start = 0.0
    placed: list[tuple[float, str, int, int, tuple[int, ...]]] = []
    for sid, turns in zip(session_ids, sessions, strict=True):
        t = start
        prev_offset: float | None = None
        for offset, n_in, n_out, ids in turns:
            if prev_offset is not None:
                t += min(max(0.0, offset - prev_offset), options.max_gap_s)
            prev_offset = offset
            placed.append((t, sid, n_in, n_out, ids))
        start += rng.expovariate(options.session_rate)
    placed.sort(key=lambda p: p[0])
    return [
        TraceRequest(i, t, n_in, max(1, n_out), ids, sid)
        for i, (t, sid, n_in, n_out, ids) in enumerate(placed)
    ]


def load_agentic(path: Path, options: AgenticReplayOptions) -> list[TraceRequest]:
    """Agentic sessions: turns keep their order and (capped) gaps; sessions start by Poisson."""
    if options.skip_sessions < 0:
        raise ValueError("skip_sessions must be >= 0")
    grouped = _group_sessions(read_jsonl(path))[options.skip_sessions :]
    if options.max_sessions is not None:
        grouped = grouped[: options.max_sessions]
    sessions = [
        [
            (
                _int(row, "timestamp") / 1000.0,
                _int(row, "input_length"),
                _int(row, "output_length"),
                _ints(row.get("hash_ids"), "hash_ids"),
            )
            for row in s.turns
        ]
        for s in grouped
    ]
    return layout_sessions(sessions, [s.session_id for s in grouped], options)


@dataclass(frozen=True, slots=True)
class SyntheticAgentOptions:
    """The built-in agent-session generator: shared system prompt and tool catalogue, then
    each session's history grows turn by turn (tool results and the model's replies)."""

    sessions: int = 16
    turns: int = 12
    max_turns: int | None = None  # turns per session drawn from turns..max_turns (None: fixed)
    system_blocks: int = 2  # shared by every session
    tool_blocks: int = 6  # shared tool catalogue
    first_user_blocks: int = 2
    growth_blocks: tuple[int, int] = (1, 3)  # new blocks per turn (min, max)
    output_tokens: tuple[int, int] = (32, 256)
    mean_gap_s: float = 5.0
    session_rate: float = 0.5
    max_gap_s: float = 30.0
    seed: int = 0


def synthetic_agent_sessions(options: SyntheticAgentOptions) -> list[TraceRequest]:
    """Generate agent sessions with real prefix structure (deterministic for a seed)."""
    rng = random.Random(options.seed)
    shared = list(range(options.system_blocks + options.tool_blocks))
    next_id = len(shared)
    sessions: list[list[tuple[float, int, int, tuple[int, ...]]]] = []
    for _ in range(options.sessions):
        history = list(shared)
        own = options.first_user_blocks
        history += range(next_id, next_id + own)
        next_id += own
        offset = 0.0
        turns: list[tuple[float, int, int, tuple[int, ...]]] = []
        count = options.turns
        if options.max_turns is not None and options.max_turns > count:
            count = rng.randint(count, options.max_turns)
        for _turn in range(count):
            n_in = TRACE_BLOCK_TOKENS * (len(history) - 1) + rng.randint(1, TRACE_BLOCK_TOKENS)
            n_out = rng.randint(*options.output_tokens)
            turns.append((offset, n_in, n_out, tuple(history)))
            grow = rng.randint(*options.growth_blocks)
            history += range(next_id, next_id + grow)
            next_id += grow
            offset += rng.expovariate(1.0 / options.mean_gap_s) if options.mean_gap_s > 0 else 0
        sessions.append(turns)
    ids = [f"syn{i:04d}" for i in range(options.sessions)]
    layout = AgenticReplayOptions(options.session_rate, options.max_gap_s, None, options.seed)
    return layout_sessions(sessions, ids, layout)


def filter_long(
    requests: Sequence[TraceRequest], max_input_tokens: int | None
) -> list[TraceRequest]:
    """Drop requests longer than a context window (re-indexed, order kept)."""
    if max_input_tokens is None:
        return list(requests)
    kept = [r for r in requests if r.input_length <= max_input_tokens]
    return [
        TraceRequest(i, r.arrival_s, r.input_length, r.output_length, r.hash_ids, r.session_id)
        for i, r in enumerate(kept)
    ]


# --- prompt text -------------------------------------------------------------------------


@lru_cache(maxsize=8192)
def block_words(hash_id: int, words: int = TRACE_BLOCK_TOKENS) -> tuple[str, ...]:
    """The words a hash id expands to: word j = xxh3_64((hash_id, j)) mod GENERATED_WORDS."""
    prefix = f"{hash_id}:".encode()
    vocab = _generated_words()  # shared string objects: a cached block is one tuple of refs
    return tuple(
        vocab[xxhash.xxh3_64_intdigest(prefix + str(j).encode()) % GENERATED_WORDS]
        for j in range(words)
    )


@cache
def _generated_words() -> tuple[str, ...]:
    return tuple(generated_word(i) for i in range(GENERATED_WORDS))


def prompt_words(
    hash_ids: Sequence[int], input_length: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> list[str]:
    """The prompt as words: each hash id expands to ``block_tokens`` words, cut to length."""
    out: list[str] = []
    for hid in hash_ids:
        if len(out) >= input_length:
            break
        out.extend(block_words(hid, block_tokens))
    return out[:input_length]


def prompt_text(
    hash_ids: Sequence[int], input_length: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> str:
    """The prompt as text (words joined by single spaces: one word is one sim token)."""
    return " ".join(prompt_words(hash_ids, input_length, block_tokens))


def scale_request(r: TraceRequest, token_scale: float) -> TraceRequest:
    """Shrink a request's lengths (``token_scale`` < 1) keeping its block structure.

    Used only when the box cannot keep up with full-size prompts; each hash id then expands
    to ``TRACE_BLOCK_TOKENS * token_scale`` words.
    """
    if token_scale == 1.0:
        return r
    block = max(1, round(TRACE_BLOCK_TOKENS * token_scale))
    full_blocks = max(0, len(r.hash_ids) - 1)
    tail = r.input_length - full_blocks * TRACE_BLOCK_TOKENS
    n_in = full_blocks * block + max(1, round(tail * token_scale))
    return TraceRequest(r.index, r.arrival_s, n_in, r.output_length, r.hash_ids, r.session_id)


def load_trace(
    spec: str,
    *,
    limit: int | None = None,
    skip: int = 0,
    agentic: AgenticReplayOptions | None = None,
    synthetic: SyntheticAgentOptions | None = None,
) -> list[TraceRequest]:
    """Load by path (format detected from the first row) or ``synthetic`` for the generator."""
    if spec == "synthetic":
        reqs = synthetic_agent_sessions(synthetic or SyntheticAgentOptions())
    else:
        path = Path(spec)
        first = next(read_jsonl(path), None)
        if first is None:
            raise ValueError(f"{path}: empty trace")
        if "session_id" in first:
            reqs = load_agentic(path, agentic or AgenticReplayOptions())
        else:
            return load_mooncake(path, limit=limit, skip=skip)
    return reqs if limit is None else reqs[:limit]
