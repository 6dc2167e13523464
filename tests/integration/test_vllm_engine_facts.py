"""What kvgate assumes about vLLM, checked against a real replica (see engines.md)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq
from vllm_helpers import (
    BLOCK,
    MODEL,
    ChatSession,
    engine_cached_tokens,
    recv_until,
    replay_from,
    usage_of,
    wait_subscribed,
)

from kvgate.backends.engines import VLLM
from kvgate.backends.vllm_cpu.launch import Fleet, ReplicaSpec
from kvgate.index.events import BlockStored, EventDecoder

pytestmark = pytest.mark.vllm


@pytest.fixture
def replica(vllm_fleet: Fleet) -> ReplicaSpec:
    return vllm_fleet.replicas[0].spec


@pytest.fixture
def engine(replica: ReplicaSpec) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=replica.url, timeout=60.0) as client:
        yield client


def _tokenize(engine: httpx.Client, messages: list[dict[str, str]]) -> list[int]:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    reply = engine.post("/tokenize", json=body)
    reply.raise_for_status()
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def test_kv_event_sources_names_the_configured_endpoints(
    engine: httpx.Client, replica: ReplicaSpec
) -> None:
    sources = engine.get("/kv_event_sources").json()
    assert set(sources) == {"0"}
    rank0 = sources["0"]
    assert rank0["enable_kv_cache_events"] is True
    assert rank0["publisher"] == "zmq"
    assert rank0["endpoint"] == replica.events_bind
    assert rank0["replay_endpoint"] == replica.replay_endpoint
    assert rank0["topic"] == "kv-events"


def test_block_stored_events_carry_the_prompt_blocks(
    engine: httpx.Client, replica: ReplicaSpec, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    session = ChatSession.start("facts-stored", seed=101)
    messages = session.ask(60)
    tokens = _tokenize(engine, messages)
    full_blocks = len(tokens) // BLOCK
    sub = wait_subscribed(zmq_context, replica.events_endpoint)
    try:
        reply = engine.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
        )
        reply.raise_for_status()
        decoder = EventDecoder()

        def stored_tokens(frames: list[list[bytes]]) -> list[int]:
            got: list[int] = []
            for frame in frames:
                for event in decoder.decode(frame[2]).events:
                    if isinstance(event, BlockStored) and event.tokens()[:BLOCK] == tokens[:BLOCK]:
                        got = event.tokens()
            return got

        frames = recv_until(sub, lambda got: bool(stored_tokens(got)))
    finally:
        sub.close(linger=0)
    assert usage_of(reply.json())[0] == len(tokens)
    for topic, seq, payload in frames:  # [topic, seq (u64 BE), msgpack payload]
        assert topic == b"kv-events"
        assert len(seq) == 8
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3  # [ts, events, data_parallel_rank]
        assert isinstance(raw[0], float) and raw[2] == 0
        assert all(isinstance(event, dict) and "type" in event for event in raw[1])
    seqs = [int.from_bytes(frame[1], "big") for frame in frames]
    assert seqs == sorted(seqs)
    batch = decoder.decode(frames[-1][2])
    stored = next(
        e
        for e in batch.events
        if isinstance(e, BlockStored) and e.tokens()[:BLOCK] == tokens[:BLOCK]
    )
    assert stored.block_size == BLOCK
    assert stored.medium == "GPU"
    assert stored.parent_block_hash is None  # a new chain from the prompt's first block
    assert len(stored.block_hashes) == full_blocks
    assert stored.tokens() == tokens[: full_blocks * BLOCK]


def test_replay_socket_resends_buffered_batches_then_ends(
    engine: httpx.Client, replica: ReplicaSpec, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    sub = wait_subscribed(zmq_context, replica.events_endpoint)
    try:
        prompt = ChatSession.start("facts-replay", seed=202).ask(40)
        engine.post("/v1/chat/completions", json={"model": MODEL, "messages": prompt}).json()
        live = recv_until(sub, bool)
    finally:
        sub.close(linger=0)
    topic, seq, payload = live[0]
    start = int.from_bytes(seq, "big")
    replayed = replay_from(zmq_context, replica.replay_endpoint, start)
    assert replayed[0] == [b"", topic, seq, payload]  # byte-identical to the live frame
    replayed_seqs = [int.from_bytes(frame[2], "big") for frame in replayed]
    assert replayed_seqs == list(range(start, start + len(replayed)))
    assert replay_from(zmq_context, replica.replay_endpoint, 2**62) == []  # only the end marker


@pytest.mark.parametrize("extra_tokens", [0, 1, 31])
def test_cached_tokens_are_whole_blocks_short_of_the_last_token(
    engine: httpx.Client, extra_tokens: int
) -> None:
    rng = random.Random(300 + extra_tokens)
    prompt = [rng.randrange(5, 4000) for _ in range(4 * BLOCK + extra_tokens)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    first = usage_of(engine.post("/v1/completions", json=body).json())
    second = usage_of(engine.post("/v1/completions", json=body).json())
    assert first == (len(prompt), 0)
    assert second == (len(prompt), engine_cached_tokens(len(prompt), cached_blocks=4))


def test_chat_usage_reports_cached_tokens_when_streamed(engine: httpx.Client) -> None:
    messages = ChatSession.start("facts-stream", seed=404).ask(50)
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    results = []
    for _ in range(2):
        with engine.stream("POST", "/v1/chat/completions", json=body) as reply:
            lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
        results.append(usage_of(msgspec.json.decode(lines[-1].removeprefix("data: "))))
    (prompt_tokens, cold), (_, warm) = results
    assert cold == 0
    assert warm == engine_cached_tokens(prompt_tokens, prompt_tokens // BLOCK)


def test_metrics_give_the_load_and_kv_capacity_kvgate_scrapes(engine: httpx.Client) -> None:
    scraped = VLLM.parse_load(engine.get("/metrics").text)
    assert scraped.running is not None and scraped.waiting is not None
    assert scraped.kv_usage is not None and 0.0 <= scraped.kv_usage <= 1.0
    # vllm:cache_config_info{num_gpu_blocks="..."}: the capacity the capacity rule reads (KV room)
    assert scraped.kv_capacity_blocks is not None and scraped.kv_capacity_blocks > 0
