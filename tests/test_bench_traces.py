"""Trace loaders, the synthetic agent generator, prompt expansion and the oracle."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from kvgate.backends.sim.config import EngineConfig, SimConfig, TimingConfig
from kvgate.backends.sim.timing import StepWork, prefill_pairs, step_seconds
from kvgate.backends.sim.vocab import vocabulary
from kvgate.bench.fleet import FleetSpec, sim_config
from kvgate.bench.oracle import idle_prefill_seconds, oracle, pooled_lru, ttft_floor
from kvgate.bench.traces import (
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


def test_agentic_loader_skips_the_first_sessions(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    rows = [
        {"session_id": f"s{i}", "timestamp": 0, "input_length": 512, "output_length": 4,
         "hash_ids": [i]}
        for i in range(4)
    ]  # fmt: skip
    _write_jsonl(path, rows)
    opts = AgenticReplayOptions(session_rate=1.0, skip_sessions=1, max_sessions=2)
    reqs = load_trace(str(path), agentic=opts)
    assert sorted(r.session_id or "" for r in reqs) == ["s1", "s2"]
    with pytest.raises(ValueError, match="skip_sessions"):
        load_trace(str(path), agentic=AgenticReplayOptions(skip_sessions=-1))


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


def test_synthetic_statistics_are_parameters() -> None:
    """Turn counts, prompt growth, shared prefix and think times follow the options."""
    opts = SyntheticAgentOptions(
        sessions=40, turns=2, max_turns=9, system_blocks=4, tool_blocks=0,
        first_user_blocks=3, growth_blocks=(5, 5), mean_gap_s=0.0, max_gap_s=0.0, seed=3,
    )  # fmt: skip
    reqs = synthetic_agent_sessions(opts)
    per_session: dict[str | None, list[TraceRequest]] = {}
    for r in reqs:
        per_session.setdefault(r.session_id, []).append(r)
    counts = {len(turns) for turns in per_session.values()}
    assert min(counts) >= 2 and max(counts) <= 9 and len(counts) > 3
    for turns in per_session.values():
        assert [len(t.hash_ids) for t in turns] == [7 + 5 * i for i in range(len(turns))]
        assert len({t.arrival_s for t in turns}) == 1  # no think time, no gap
        assert turns[0].hash_ids[:4] == (0, 1, 2, 3)


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


def test_oracle_reports_each_request_in_arrival_order() -> None:
    reqs = [
        TraceRequest(0, 1.0, 1024, 1, (0, 2)),
        TraceRequest(1, 0.0, 1024, 1, (0, 1)),
    ]
    assert oracle(reqs).per_request == ((1024, 0), (1024, 512))


def test_idle_prefill_is_the_simulators_own_steps() -> None:
    timing = TimingConfig(speedup=2.0)
    # 20k uncached tokens after a 4k hit, chunks of 8192: 8192 + 8192 + 3616
    expected = sum(
        step_seconds(StepWork(tokens=n, prefill_pairs=prefill_pairs(start, n)), timing)
        for start, n in ((4096, 8192), (12288, 8192), (20480, 3616))
    )
    assert idle_prefill_seconds(24096, 4096, timing, 8192) == pytest.approx(expected)
    # a full hit still computes one token (one step at the step floor), as vLLM does
    one = idle_prefill_seconds(1024, 1024, timing, 8192)
    assert one == pytest.approx(timing.step_floor_ms / 1000 / timing.speedup, rel=0.01)
    assert idle_prefill_seconds(1024, 0, timing, 8192) > one


def test_ttft_floor_uses_whole_cached_blocks_and_the_fleet_config() -> None:
    reqs = [TraceRequest(0, 0.0, 600, 1, (0, 1)), TraceRequest(1, 1.0, 1536, 1, (0, 1, 2))]
    o = oracle(reqs)  # the second request hits 600 tokens: 592 in whole 16-token blocks
    sim = SimConfig(engine=EngineConfig(block_size=16), timing=TimingConfig(speedup=4.0))
    floor = ttft_floor(o, sim)
    assert floor[1] == pytest.approx(idle_prefill_seconds(1536, 592, sim.timing, 8192))
    parsed = sim_config(FleetSpec(speedup=4.0, block_size=32, extra_args=("--token-us", "10")))
    assert (parsed.timing.speedup, parsed.engine.block_size) == (4.0, 32)
    assert parsed.timing.token_us == 10.0


def test_ttft_floor_follows_the_engine_model() -> None:
    """Prefill speed (``--prefill-slowdown``), the chunk budget and the prefill mode of the
    fleet reach the floor as ``kvgate sim`` parses them; serial prefill alone is chunked."""
    reqs = [TraceRequest(0, 0.0, 20_000, 1, tuple(range(40)))]
    o = oracle(reqs)

    def floor(*extra: str) -> float:
        return ttft_floor(o, sim_config(FleetSpec(extra_args=extra)))[0]

    base = floor()
    slow, fast = floor("--prefill-slowdown", "2"), floor("--prefill-slowdown", "0.5")
    # 20k tokens are compute and attention bound (far above the step floor): both scale
    assert slow == pytest.approx(2 * base) and fast == pytest.approx(base / 2)
    assert floor("--prefill-mode", "serial") == base
    # 512-token chunks: 40 steps instead of 3, the same tokens and attention pairs; only
    # the last 32-token chunk is raised to the step floor
    assert base < floor("--max-num-batched-tokens", "512") < 1.01 * base
    assert floor("--max-num-batched-tokens", "512", "--step-floor-ms", "20") > base


def test_pooled_lru_keeps_what_fits_and_evicts_least_recent() -> None:
    def req(i: int, ids: tuple[int, ...]) -> TraceRequest:
        return TraceRequest(i, float(i), 512 * len(ids), 1, ids)

    a, b, c = (0, 1), (5, 6), (8, 9)
    reqs = [req(0, a), req(1, b), req(2, a)]
    assert pooled_lru(reqs, 4096).hit_tokens == oracle(reqs).hit_tokens == 1024  # all fits
    assert pooled_lru(reqs, 1536).hit_tokens == 0  # b pushed out a's first block
    # a touched again before c arrives: c evicts b instead, and a hits once more
    touched = [req(0, a), req(1, b), req(2, a), req(3, c), req(4, a)]
    assert [hit for _, hit in pooled_lru(touched, 2048).per_request] == [0, 0, 1024, 0, 1024]
    untouched = [req(0, a), req(1, b), req(2, c), req(3, a)]
    assert pooled_lru(untouched, 2048).hit_tokens == 0
