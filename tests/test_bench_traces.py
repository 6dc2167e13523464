"""Trace loaders, the synthetic agent generator, prompt expansion and the oracle."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from backends.sim.vocab import vocabulary
from bench.oracle import oracle
from bench.traces import (
    AgenticReplayOptions,
    SyntheticAgentOptions,
    TraceRequest,
    filter_long,
    load_trace,
    prompt_text,
    prompt_words,
    scale_request,
    synthetic_agent_sessions,
)


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text)


def test_mooncake_loader_rebases_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write_jsonl(
        path,
        [
            {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 700, "output_length": 0, "hash_ids": [0, 2]},
            {"timestamp": 4000, "input_length": 10, "output_length": 3, "hash_ids": [9]},
        ],
    )
    reqs = load_trace(str(path), skip=1)
    assert [r.arrival_s for r in reqs] == [0.0, 2.5]
    assert reqs[0].output_length == 1  # at least one token is asked for
    assert reqs[0].session_id is None
    assert len(load_trace(str(path), limit=2)) == 2


def test_agentic_loader_keeps_turn_order_and_caps_gaps(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    rows: list[dict[str, object]] = []
    for sid in ("s0", "s1"):
        for k, ts in enumerate([0, 5_000, 500_000]):
            rows.append(
                {
                    "session_id": sid,
                    "parent_session_id": None,
                    "timestamp": ts,
                    "input_length": 512 * (k + 1),
                    "output_length": 4,
                    "hash_ids": list(range(k + 1)),
                }
            )
    _write_jsonl(path, rows)
    reqs = load_trace(str(path), agentic=AgenticReplayOptions(session_rate=1.0, max_gap_s=20.0))
    assert len(reqs) == 6
    by_session: dict[str | None, list[TraceRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(turns)]
        assert gaps == pytest.approx([5.0, 20.0])
        assert [t.input_length for t in turns] == [512, 1024, 1536]
    assert [r.index for r in reqs] == list(range(6))
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s)


def test_synthetic_sessions_share_prefix_and_grow() -> None:
    opts = SyntheticAgentOptions(sessions=3, turns=4, system_blocks=2, tool_blocks=3, seed=7)
    reqs = synthetic_agent_sessions(opts)
    assert reqs == synthetic_agent_sessions(opts)  # deterministic for a seed
    assert len(reqs) == 12
    for r in reqs:
        assert r.hash_ids[:5] == (0, 1, 2, 3, 4)
        assert 512 * (len(r.hash_ids) - 1) < r.input_length <= 512 * len(r.hash_ids)
    s0 = [r for r in reqs if r.session_id == "syn0000"]
    for a, b in itertools.pairwise(s0):
        assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids
        assert len(b.hash_ids) > len(a.hash_ids)
    o = oracle(reqs)
    assert 0.5 < o.token_hit_rate < 1.0


def test_prompt_expansion_is_deterministic_real_words() -> None:
    words = prompt_words((3, 4), 700)
    assert len(words) == 700
    assert set(words) <= set(vocabulary())
    assert prompt_text((3, 4), 700) == " ".join(words)
    # same hash id at the same position: same text; the partial block is a prefix of the full
    assert prompt_words((3, 5), 600)[:512] == words[:512]
    assert prompt_words((3, 4), 1024)[:700] == words
    assert prompt_words((3,), 512) != prompt_words((4,), 512)


def test_scale_and_filter() -> None:
    r = TraceRequest(0, 0.0, 512 * 2 + 100, 8, (1, 2, 3))
    s = scale_request(r, 0.125)
    assert s.input_length == 64 * 2 + 12
    assert len(prompt_words(s.hash_ids, s.input_length, 64)) == s.input_length
    kept = filter_long([r, TraceRequest(1, 1.0, 10, 1, (9,))], 100)
    assert [k.input_length for k in kept] == [10] and kept[0].index == 0


def test_oracle_counts_prefix_reuse_only() -> None:
    reqs = [
        TraceRequest(0, 0.0, 1024, 1, (0, 1)),
        TraceRequest(1, 1.0, 1024, 1, (0, 2)),  # block 0 reused
        TraceRequest(2, 2.0, 1024, 1, (5, 1)),  # id 1 at another prefix: not reused
        TraceRequest(3, 3.0, 1536, 1, (0, 1, 7)),  # two blocks reused
    ]
    o = oracle(reqs)
    assert o.hit_tokens == 512 + 1024
    assert o.hit_blocks == 3
    assert o.token_hit_rate == pytest.approx(1536 / (3 * 1024 + 1536))


def test_oracle_partial_block_hits_only_what_was_seen() -> None:
    reqs = [
        TraceRequest(0, 0.0, 600, 1, (0, 1)),  # block 1 has 88 tokens
        TraceRequest(1, 1.0, 1536, 1, (0, 1, 2)),  # sees 512 + 88, then stops
    ]
    assert oracle(reqs).hit_tokens == 600
    assert oracle(reqs, engine_block_size=16).hit_tokens == 592
