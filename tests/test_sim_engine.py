"""The engine's scheduler and step-time model, driven directly (no HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from kvgate.backends.sim.config import ConfigError, EngineConfig, TimingConfig
from kvgate.backends.sim.engine import Engine, SimRequest
from kvgate.backends.sim.faults import FaultState
from kvgate.backends.sim.timing import StepWork, prefill_pairs, step_seconds
from kvgate.index.events import KvEvent

pytestmark = pytest.mark.anyio


@dataclass
class Recorder:
    admitted: list[tuple[int, int, int]] = field(default_factory=list)
    remote: list[int] = field(default_factory=list)
    transfers: list[tuple[int, int]] = field(default_factory=list)
    preempted: int = 0
    batches: list[list[KvEvent]] = field(default_factory=list)
    engine: Engine | None = None
    first_token_steps: list[int] = field(default_factory=list)
    """``engine.steps`` when each first token came (the engine counts the step first)."""

    def on_admitted(
        self,
        prompt_tokens: int,
        gpu_hit_tokens: int,
        cpu_hit_tokens: int,
        remote_tokens: int,
        prefill_leg: bool,
    ) -> None:
        self.admitted.append((prompt_tokens, gpu_hit_tokens, cpu_hit_tokens))
        self.remote.append(remote_tokens)

    def on_transfer(self, pulled_tokens: int, used_tokens: int) -> None:
        self.transfers.append((pulled_tokens, used_tokens))

    def on_first_token(self, ttft_s: float) -> None:
        assert ttft_s >= 0
        if self.engine is not None:
            self.first_token_steps.append(self.engine.steps)

    def on_finished(self, req: SimRequest, reason: str, e2e_s: float) -> None:
        assert reason == "length"

    def on_preempted(self) -> None:
        self.preempted += 1


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@contextlib.asynccontextmanager
async def _engine(
    config: EngineConfig, recorder: Recorder, timing: TimingConfig | None = None
) -> AsyncIterator[Engine]:
    engine = Engine(
        config,
        timing=TimingConfig(speedup=1000.0) if timing is None else timing,
        faults=FaultState(random.Random(0), time.monotonic),
        rng=random.Random(0),
        hash_seed=1,
        first_output_id=1000,
        on_batch=recorder.batches.append,
        observer=recorder,
    )
    recorder.engine = engine
    task = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _finish(req: SimRequest) -> list[int]:
    while await req.stream.next():
        pass
    assert req.stream.error is None
    return req.output_ids


async def test_long_prompts_are_prefilled_in_chunks(recorder: Recorder) -> None:
    config = EngineConfig(block_size=4, capacity_blocks=64, max_num_batched_tokens=8)
    async with _engine(config, recorder) as engine:
        req = engine.submit(list(range(10, 40)), 3, None, time.monotonic())
        first = await req.stream.next()
        assert len(first) == 1
        assert engine.steps == 4  # 30 prompt tokens, 8 per step
        assert len(await _finish(req)) == 3


@pytest.mark.parametrize(
    ("mode", "steps"),
    [
        ("chunked", [2, 2]),  # step 2: the last 4 tokens of A and all of B share the budget
        ("serial", [2, 3]),  # step 2 is A's alone: B waits for every prefill ahead of it
    ],
)
async def test_prefill_mode_decides_who_shares_the_budget(
    recorder: Recorder, mode: str, steps: list[int]
) -> None:
    config = EngineConfig(
        block_size=4, capacity_blocks=64, max_num_batched_tokens=16, prefill_mode=mode
    )
    async with _engine(config, recorder) as engine:
        a = engine.submit(list(range(10, 30)), 1, None, time.monotonic())  # 20 tokens
        b = engine.submit(list(range(50, 54)), 1, None, time.monotonic())  # 4 tokens
        await asyncio.gather(_finish(a), _finish(b))
    assert recorder.first_token_steps == steps


async def test_serial_prefill_still_batches_decodes(recorder: Recorder) -> None:
    config = EngineConfig(
        block_size=4, capacity_blocks=64, max_num_batched_tokens=8, prefill_mode="serial"
    )
    async with _engine(config, recorder) as engine:
        a = engine.submit(list(range(10, 14)), 5, None, time.monotonic())  # 4-token prompt
        b = engine.submit(list(range(50, 70)), 1, None, time.monotonic())  # 20 tokens
        c = engine.submit(list(range(80, 84)), 1, None, time.monotonic())  # 4 tokens
        await asyncio.gather(_finish(a), _finish(b), _finish(c))
        # A alone in step 1; B's chunks (8, 8, 4) in steps 2-4 beside A's decodes; C after B
        assert recorder.first_token_steps == [1, 4, 5]
        assert engine.steps == 5  # A's 4 decode tokens ran in steps 2-5, with the prefills


def test_serial_mode_is_a_validated_engine_setting() -> None:
    with pytest.raises(ConfigError, match="prefill_mode"):
        EngineConfig(prefill_mode="eager").validate()  # type: ignore[arg-type]


async def test_prefix_hits_stop_before_the_last_token(recorder: Recorder) -> None:
    config = EngineConfig(block_size=4, capacity_blocks=64)
    async with _engine(config, recorder) as engine:
        prompt = list(range(100, 116))  # exactly 4 blocks
        await _finish(engine.submit(list(prompt), 1, None, time.monotonic()))
        second = engine.submit(list(prompt), 1, None, time.monotonic())
        await _finish(second)
        assert second.cached_tokens == 12  # the 4th block holds the last token: recomputed
        salted = engine.submit(list(prompt), 1, "tenant-b", time.monotonic())
        await _finish(salted)
        assert salted.cached_tokens == 0  # a cache salt never shares blocks
    assert recorder.admitted == [(16, 0, 0), (16, 12, 0), (16, 0, 0)]


async def test_cpu_tier_hits_are_loaded_back(recorder: Recorder) -> None:
    config = EngineConfig(block_size=4, capacity_blocks=8, cpu_offload_blocks=32)
    async with _engine(config, recorder) as engine:
        prompt = list(range(200, 224))  # 6 blocks
        await _finish(engine.submit(list(prompt), 1, None, time.monotonic()))
        await _finish(engine.submit(list(range(300, 328)), 1, None, time.monotonic()))  # evicts
        again = engine.submit(list(prompt), 1, None, time.monotonic())
        await _finish(again)
        assert again.cached_tokens == 20
    prompt_tokens, gpu_hits, cpu_hits = recorder.admitted[-1]
    assert (prompt_tokens, gpu_hits + cpu_hits) == (24, 20) and cpu_hits > 0


async def test_out_of_blocks_preempts_and_everything_finishes(recorder: Recorder) -> None:
    config = EngineConfig(block_size=4, capacity_blocks=16, max_num_batched_tokens=64)
    async with _engine(config, recorder) as engine:
        reqs = [engine.submit([7 + i] * 10, 20, None, time.monotonic()) for i in range(4)]
        outputs = await asyncio.gather(*(_finish(r) for r in reqs))
        assert [len(o) for o in outputs] == [20] * 4
        assert engine.cache.free_blocks == 16
    assert recorder.preempted > 0


async def test_abort_frees_blocks_and_keeps_cached_ones(recorder: Recorder) -> None:
    config = EngineConfig(block_size=4, capacity_blocks=2000)
    async with _engine(config, recorder) as engine:
        req = engine.submit(list(range(10, 30)), 5000, None, time.monotonic())
        await req.stream.next()
        engine.abort(req)
        assert not engine.running and engine.cache.free_blocks == 2000
        assert len(engine.cache.snapshot().gpu) >= 5  # the prompt's blocks stay cached


def test_submit_rejects_what_cannot_fit(recorder: Recorder) -> None:
    config = EngineConfig(block_size=4, capacity_blocks=4)
    engine = Engine(
        config, timing=TimingConfig(), faults=FaultState(random.Random(0), time.monotonic),
        rng=random.Random(0), hash_seed=1, first_output_id=1000,
        on_batch=recorder.batches.append, observer=recorder,
    )  # fmt: skip
    assert config.effective_max_model_len == 16
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit([1] * 10, 7, None, 0.0)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], 1, None, 0.0)


def test_step_time_model() -> None:
    timing = TimingConfig(step_floor_ms=6.0, token_us=30.0, prefill_attn_ns=1.0,
                          decode_kv_ns=49.0, cpu_load_us_per_token=5.2)  # fmt: skip
    # a lone decode step is bound by the weights read
    assert step_seconds(StepWork(tokens=1, decode_context=1000), timing) == pytest.approx(
        0.006 + 1000 * 49e-9
    )
    # a 1000-token prefill is compute bound, plus its attention pairs
    prefill = StepWork(tokens=1000, prefill_pairs=prefill_pairs(0, 1000))
    assert step_seconds(prefill, timing) == pytest.approx(0.030 + 499_500 * 1e-9)
    loaded = StepWork(tokens=1, cpu_loaded_tokens=160)
    assert step_seconds(loaded, timing) == pytest.approx(0.006 + 160 * 5.2e-6)
    fast = TimingConfig(speedup=10.0)
    assert step_seconds(StepWork(tokens=1), fast, slowdown=2.0) == pytest.approx(0.006 * 2 / 10)
    assert prefill_pairs(5, 3) == 5 + 6 + 7


def test_prefill_slowdown_scales_the_prefill_share_only() -> None:
    timing = TimingConfig()
    mixed = StepWork(tokens=1010, prefill_tokens=1000, prefill_pairs=prefill_pairs(0, 1000),
                     decode_context=10 * 2000)  # fmt: skip
    # compute of 1000 prefill tokens x 3 plus 10 decode tokens, prefill attention x 3
    assert step_seconds(mixed, timing, prefill_slowdown=3.0) == pytest.approx(
        (3000 + 10) * 30e-6 + 3 * 499_500 * 1e-9 + 20_000 * 49e-9
    )
    decode = StepWork(tokens=10, decode_context=20_000)
    assert step_seconds(decode, timing, prefill_slowdown=3.0) == step_seconds(decode, timing)


def _hold_the_loop(seconds: float) -> None:
    """Keep the event loop's thread busy for ``seconds`` (a simulator short of CPU)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_steps_that_begin_late_are_counted_and_idle_time_is_not(recorder: Recorder) -> None:
    """``late_s``: a step that begins after its modelled start (the event loop held by a
    blocking call, as in a simulator short of CPU) adds its delay past ``catch_up_ms``;
    time with nothing to do (the loop held while the engine is idle) does not."""
    hold_s = 0.3
    catch_up_s = TimingConfig().catch_up_ms / 1000
    config = EngineConfig(block_size=4, capacity_blocks=64)
    async with _engine(config, recorder) as engine:

        def submit(first_token: int) -> SimRequest:
            return engine.submit(list(range(first_token, first_token + 10)), 5, None, 0.0)

        assert len(await _finish(submit(10))) == 5
        before = engine.late_s
        _hold_the_loop(hold_s)  # nothing to do: idle, not late
        assert len(await _finish(submit(30))) == 5
        assert engine.late_s - before < hold_s
        before = engine.late_s
        req = submit(50)
        assert len(await req.stream.next()) == 1  # decoding: the next step is due at once
        _hold_the_loop(hold_s)  # mid-request: the next step begins that much late
        await _finish(req)
        assert engine.late_s - before >= (hold_s - catch_up_s) * 0.9


async def test_a_delay_within_catch_up_is_made_up_by_the_steps_after(recorder: Recorder) -> None:
    """The loop held mid-request for less than ``catch_up_ms``: nothing is counted late and
    the request still finishes at its modelled time (8 steps of 50 ms), not that much later."""
    step_s, hold_s = 0.05, 0.3
    timing = TimingConfig(step_floor_ms=step_s * 1000, token_us=0, decode_kv_ns=0,
                          prefill_attn_ns=0, catch_up_ms=1000)  # fmt: skip
    async with _engine(EngineConfig(block_size=4, capacity_blocks=64), recorder, timing) as engine:
        start = time.monotonic()
        req = engine.submit(list(range(10, 20)), 8, None, start)
        assert len(await req.stream.next()) == 1  # after the prefill step
        _hold_the_loop(hold_s)
        await _finish(req)
        elapsed = time.monotonic() - start
        assert engine.late_s == 0.0
        assert engine.steps == 8
        assert elapsed < 8 * step_s + hold_s / 2  # without catching up: 8 steps + the hold
