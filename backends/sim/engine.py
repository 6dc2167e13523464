"""The simulated engine: vLLM-v1-style continuous batching over the block cache.

Each step (one ``asyncio`` sleep of the modelled step time):

1. running requests first, in order: a prefill chunk or one decode token each, within the
   ``max_num_batched_tokens`` budget; a request that cannot get a block preempts the last
   running request (its blocks are freed, it goes back to the head of the queue and later
   recomputes, helped by the prefix cache);
2. then, if nothing was preempted, waiting requests in arrival order while the budget, the
   ``max_num_seqs`` limit and the free blocks allow: the longest cached prefix (GPU, then
   CPU tier) is reused, at most ``(len - 1) // block_size`` blocks (the last token is always
   computed), and the rest is prefilled in chunks. With ``prefill_mode`` ``serial`` at most
   one request prefills per step (the oldest running one, else the head of the queue);
   decodes still join every step;
3. blocks that become full are cached (``BlockStored``) when scheduled, as vLLM does;
4. after the step, every request whose prompt is fully computed gets one token; a request
   with ``max_tokens`` tokens finishes and frees its blocks tail first.

The step's KV events are published as one batch after the step. While a ``pause`` fault
holds, no step runs (requests queue); a ``slow``/``slow_prefill`` fault stretches steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import xxhash

from kvgate.backends.sim.cache import BlockCache
from kvgate.backends.sim.config import EngineConfig, TimingConfig
from kvgate.backends.sim.faults import FaultState
from kvgate.backends.sim.lora import Adapter
from kvgate.backends.sim.timing import StepWork, prefill_pairs, step_seconds
from kvgate.backends.sim.vocab import GENERATED_WORDS
from kvgate.index.events import KvEvent

_MIN_SLEEP_S = 0.001
"""Shorter steps are not slept one by one: their time accumulates until it is worth a
sleep, so fast replays keep the modelled throughput on average."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class EngineObserver(Protocol):
    """What the engine reports (implemented by ``ReplicaMetrics``)."""

    def on_admitted(
        self,
        prompt_tokens: int,
        gpu_hit_tokens: int,
        cpu_hit_tokens: int,
        remote_tokens: int,
        prefill_leg: bool,
    ) -> None:
        """A request entered the running batch for the first time (``remote_tokens``: its
        prompt tokens a KV transfer brought, beyond what it found here; ``prefill_leg``: it
        prefills for a remote decode)."""

    def on_transfer(self, pulled_tokens: int, used_tokens: int) -> None:
        """A decode leg entered the batch with ``pulled_tokens`` prompt tokens brought by a KV
        transfer, ``used_tokens`` of them not already held here."""

    def on_first_token(self, ttft_s: float) -> None:
        """A request produced its first token."""

    def on_finished(self, req: SimRequest, reason: str, e2e_s: float) -> None:
        """A request finished normally."""

    def on_preempted(self) -> None:
        """A running request was preempted for lack of free blocks."""


@dataclass(frozen=True, slots=True)
class RequestFault:
    """An ``abort`` fault drawn for one request: it fails when it would produce token
    ``after_tokens + 1``; ``drop``: its connection is dropped instead of an error answer."""

    after_tokens: int = 0
    drop: bool = False


class TokenStream:
    """Tokens of one request as the engine produces them, read by the HTTP handler."""

    __slots__ = ("_pending", "_waiter", "dropped", "error", "finish_reason")

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._waiter: asyncio.Future[None] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.dropped = False
        """The request failed so that its connection goes down (a crash), not with an error."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def push(self, token_id: int) -> None:
        self._pending.append(token_id)
        self._wake()

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._wake()

    def fail(self, message: str, drop: bool = False) -> None:
        if not self.done:
            self.error = message
            self.dropped = drop
        self._wake()

    async def next(self) -> list[int]:
        """Tokens produced since the last call; empty only once the stream is done."""
        while not self._pending and not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        tokens, self._pending = self._pending, []
        return tokens


class SimRequest:
    """One request inside the engine."""

    __slots__ = (
        "arrival",
        "blocks",
        "cache_salt",
        "cached_tokens",
        "fault",
        "hashes",
        "kept",
        "lora",
        "max_tokens",
        "num_computed",
        "num_output",
        "num_registered",
        "prompt_len",
        "remote_tokens",
        "state",
        "stream",
        "token_ids",
    )

    def __init__(
        self,
        token_ids: list[int],
        max_tokens: int,
        cache_salt: str | None,
        arrival: float,
        *,
        lora: Adapter | None = None,
        fault: RequestFault | None = None,
        remote_tokens: int = 0,
        keep: bool = False,
    ) -> None:
        self.token_ids = token_ids
        self.remote_tokens = remote_tokens  # prompt tokens whose KV a transfer brought
        # a prefill for a remote decode: its prompt's blocks, kept when it ends (else None)
        self.kept: list[int] | None = [] if keep else None
        self.prompt_len = len(token_ids)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.lora = lora
        self.fault = fault
        self.arrival = arrival
        self.num_computed = 0
        self.num_output = 0
        self.num_registered = 0
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.cached_tokens = -1
        self.state = RequestState.WAITING
        self.stream = TokenStream()

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


class Engine:
    """One replica's scheduler, block cache and step loop."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        timing: TimingConfig,
        faults: FaultState,
        rng: random.Random,
        hash_seed: int,
        first_output_id: int,
        on_batch: Callable[[list[KvEvent]], None],
        observer: EngineObserver,
    ) -> None:
        self.config = config
        self.timing = timing
        self.faults = faults
        self._rng = rng
        self._first_output_id = first_output_id
        self._on_batch = on_batch
        self._observer = observer
        self._hash_seed = hash_seed
        self.cache = self._new_cache()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wakeup = asyncio.Event()
        self._epoch = 0
        self.steps = 0
        self.busy_s = 0.0
        """Sum of the modelled step times (wall seconds, after speed-up and slowdown)."""
        self.late_s = 0.0
        """Wall seconds lost to the model: steps that began more than ``catch_up_ms`` after
        their modelled start (the previous step's end) by the simulator's own work (its
        steps' bookkeeping, streams and events, timer slack, other replicas in its loop, a
        process short of CPU) lengthen the run; delays up to it are made up."""
        self._catch_up_s = timing.catch_up_ms / 1000.0

    # --- requests ------------------------------------------------------------------------

    def submit(
        self,
        token_ids: list[int],
        max_tokens: int,
        cache_salt: str | None,
        arrival: float,
        *,
        lora: Adapter | None = None,
        fault: RequestFault | None = None,
        remote_tokens: int = 0,
        keep: bool = False,
    ) -> SimRequest:
        """Queue a request (``arrival``: ``time.monotonic()`` when it was received), served
        with adapter ``lora`` (its blocks are cached apart) and failing as ``fault`` says;
        ``remote_tokens``: its prompt's first tokens arrived by a KV transfer (loaded, not
        computed); ``keep``: its prompt's block ids are kept in ``kept`` when it ends (a
        prefill for a remote decode)."""
        if not token_ids or len(token_ids) + max_tokens > self.config.effective_max_model_len:
            raise ValueError("empty request, or longer than the effective max_model_len")
        req = SimRequest(
            token_ids,
            max_tokens,
            cache_salt,
            arrival,
            lora=lora,
            fault=fault,
            remote_tokens=remote_tokens,
            keep=keep,
        )
        self.waiting.append(req)
        self._wakeup.set()
        return req

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client gone): its blocks are freed, cached blocks stay cached."""
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
        elif req.state is RequestState.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            return
        req.state = RequestState.ABORTED

    def fail_all(self, reason: str, drop: bool = False) -> None:
        """Every queued and running request ends with an error (``drop``: with its connection
        dropped); cached blocks stay cached."""
        for req in (*self.waiting, *self.running):
            if req.state is RequestState.RUNNING:
                self._release(req)
            req.state = RequestState.ABORTED
            req.stream.fail(reason, drop)
        self.waiting.clear()
        self.running.clear()
        self._wakeup.set()

    def restart(self, hash_seed: int, reason: str, drop: bool = False) -> None:
        """Engine crash and restart: requests fail, the cache starts empty, new hash seed."""
        self.fail_all(reason, drop)
        self._hash_seed = hash_seed
        self.cache = self._new_cache()
        self._epoch += 1
        self._wakeup.set()

    def _new_cache(self) -> BlockCache:
        cfg = self.config
        return BlockCache(cfg.capacity_blocks, cfg.block_size, cfg.cpu_offload_blocks)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: only when no block is in use; ``AllBlocksCleared``."""
        done = self.cache.reset()
        if done:
            self._wakeup.set()
        return done

    def wake(self) -> None:
        """Look at the faults again (a ``pause`` was cleared)."""
        self._wakeup.set()

    # --- the step loop -------------------------------------------------------------------

    async def run(self) -> None:
        deadline = time.monotonic()  # the modelled end of the last step
        while True:
            if await self._paused():
                deadline = time.monotonic()
                continue
            scheduled: list[tuple[SimRequest, int]] = []
            work = StepWork()
            if self.running or self.waiting:
                scheduled = self._schedule(work)
            if not scheduled:
                self._flush_events()
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = time.monotonic()  # idle: the next step starts from now
                continue
            epoch = self._epoch
            now = time.monotonic()
            faults = self.faults
            duration = step_seconds(work, self.timing, faults.slowdown(), faults.prefill_slowdown())
            self.busy_s += duration
            deadline = self._caught_up(deadline, now) + duration
            delay = deadline - now
            await asyncio.sleep(delay if delay >= _MIN_SLEEP_S else 0)
            if epoch != self._epoch:
                continue
            self.steps += 1
            self._complete(scheduled, time.monotonic())
            self._flush_events()

    def _caught_up(self, deadline: float, now: float) -> float:
        """When this step starts in the model: the end of the step before, while that is at
        most ``catch_up_ms`` behind ``now`` (the step then sleeps less, making the delay
        up), else ``catch_up_ms`` before ``now``: the rest is lost, counted in ``late_s``."""
        lost = now - self._catch_up_s - deadline
        if lost <= 0:
            return deadline
        self.late_s += lost
        return deadline + lost

    async def _paused(self) -> bool:
        """Wait while a ``pause`` fault holds (until it is cleared or ends); True if it did."""
        fault = self.faults.active("pause")
        if fault is None:
            return False
        self._wakeup.clear()
        left = None if fault.until is None else max(fault.until - time.monotonic(), 0.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), left)
        return True

    def _flush_events(self) -> None:
        events = self.cache.events
        if events:
            self.cache.events = []
            self._on_batch(events)

    def _schedule(self, work: StepWork) -> list[tuple[SimRequest, int]]:
        budget = self.config.max_num_batched_tokens
        serial = self.config.prefill_mode == "serial"
        prefilling = False  # serial mode: one request prefills per step
        scheduled: list[tuple[SimRequest, int]] = []
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if serial and not _decoding(req):
                if prefilling:
                    i += 1
                    continue
                prefilling = True
            n = min(len(req.token_ids) - req.num_computed, budget)
            if self._grow(req, req.num_computed + n):
                self._account(work, req, n)
                scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            self._preempt(running.pop())
            preempted = True
        while not preempted and not prefilling and self.waiting and budget > 0:
            if len(running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            n = self._admit(req, budget, work)
            if n == 0:
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            running.append(req)
            self._account(work, req, n)
            scheduled.append((req, n))
            budget -= n
            prefilling = serial
        return scheduled

    @staticmethod
    def _account(work: StepWork, req: SimRequest, n: int) -> None:
        work.tokens += n
        if _decoding(req):
            work.decode_context += req.num_computed
        else:
            work.prefill_tokens += n
            work.prefill_pairs += prefill_pairs(req.num_computed, n)

    def _complete(self, scheduled: list[tuple[SimRequest, int]], now: float) -> None:
        finished = False
        for req, n in scheduled:
            if req.state is not RequestState.RUNNING:
                continue
            req.num_computed += n
            if req.num_computed < len(req.token_ids):
                continue
            fault = req.fault
            if fault is not None and req.num_output >= fault.after_tokens:
                req.state = RequestState.ABORTED
                self._release(req)
                req.stream.fail("simulated engine error (fault 'abort')", fault.drop)
                finished = True
                continue
            token = self._first_output_id + self._rng.randrange(GENERATED_WORDS)
            req.token_ids.append(token)
            req.num_output += 1
            if req.num_output == 1:
                self._observer.on_first_token(now - req.arrival)
            req.stream.push(token)
            if req.num_output >= req.max_tokens:
                req.state = RequestState.FINISHED
                self._release(req)
                req.stream.finish("length")
                self._observer.on_finished(req, "length", now - req.arrival)
                finished = True
        if finished:
            self.running = [r for r in self.running if r.state is RequestState.RUNNING]

    # --- blocks --------------------------------------------------------------------------

    def _admit(self, req: SimRequest, budget: int, work: StepWork) -> int:
        """Reuse the cached prefix and allocate the first chunk; 0 if blocks are short."""
        cache, bs = self.cache, self.config.block_size
        total = len(req.token_ids)
        max_hit = (total - 1) // bs
        hashes = self._hashes(req, max_hit)
        gpu_hit = cache.gpu_prefix(hashes, max_hit)
        g = len(gpu_hit)
        c = cache.cpu_prefix(hashes, g, max_hit) if cache.cpu_capacity else 0
        r = max(min(req.remote_tokens // bs, max_hit) - g - c, 0)  # arrived by a transfer
        computed = (g + c + r) * bs
        n = min(total - computed, budget)
        need = -(-(computed + n) // bs) - g
        if need > cache.free_blocks - cache.evictable(gpu_hit):
            return 0
        cache.touch(gpu_hit)
        if c:
            cache.touch_cpu(hashes[g : g + c])
        new = cache.allocate(need)
        if new is None:  # pragma: no cover - checked just above
            raise RuntimeError("block accounting broke")
        req.blocks = gpu_hit + new
        req.num_registered = g
        if c + r:  # loaded (CPU tier, transfer): stored in the cache as vLLM stores them
            parent = hashes[g - 1] if g else None
            tokens = req.token_ids[g * bs : (g + c + r) * bs]
            cache.register(
                new[: c + r], hashes[g : g + c + r], parent, tokens, req.cache_salt, lora=req.lora
            )
            req.num_registered = g + c + r
            work.cpu_loaded_tokens += c * bs
        if req.remote_tokens:
            self._observer.on_transfer(req.remote_tokens, r * bs)
        req.remote_tokens = 0  # once: a preempted request computes them again
        req.num_computed = computed
        self._register_full(req, computed + n)
        if req.cached_tokens < 0:
            req.cached_tokens = computed
            self._observer.on_admitted(total, g * bs, c * bs, r * bs, req.kept is not None)
        return n

    def _grow(self, req: SimRequest, total_tokens: int) -> bool:
        need = -(-total_tokens // self.config.block_size) - len(req.blocks)
        if need > 0:
            new = self.cache.allocate(need)
            if new is None:
                return False
            req.blocks.extend(new)
        self._register_full(req, total_tokens)
        return True

    def _register_full(self, req: SimRequest, total_tokens: int) -> None:
        bs = self.config.block_size
        full = total_tokens // bs
        start = req.num_registered
        if full <= start:
            return
        hashes = self._hashes(req, full)
        parent = hashes[start - 1] if start else None
        self.cache.register(
            req.blocks[start:full],
            hashes[start:full],
            parent,
            req.token_ids[start * bs : full * bs],
            req.cache_salt,
            lora=req.lora,
        )
        req.num_registered = full

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        req.num_computed = 0
        req.num_registered = 0
        req.state = RequestState.WAITING
        self.waiting.appendleft(req)
        self._observer.on_preempted()

    def _release(self, req: SimRequest) -> None:
        if req.kept is not None and not req.kept:
            req.kept = req.blocks[: req.prompt_len // self.config.block_size]
        self.cache.free(req.blocks[::-1])
        req.blocks = []

    def _hashes(self, req: SimRequest, n_blocks: int) -> list[int]:
        """The request's chained block hashes, extended to ``n_blocks`` full blocks."""
        hashes = req.hashes
        have = len(hashes)
        if n_blocks <= have:
            return hashes
        bs, seed = self.config.block_size, self._hash_seed
        data = array("i", req.token_ids[have * bs : n_blocks * bs]).tobytes()
        parent = hashes[-1] if have else xxhash.xxh3_64_intdigest(_root(req), seed=seed)
        step = 4 * bs
        digest = xxhash.xxh3_64_intdigest
        for k in range(0, len(data), step):
            parent = digest(parent.to_bytes(8, "little") + data[k : k + step], seed=seed)
            hashes.append(parent)
        return hashes


def _decoding(req: SimRequest) -> bool:
    """Is the request's next step a decode (one token after its last output), not prefill
    (its prompt, or a preempted request's prompt and outputs, being computed)?"""
    return req.num_output > 0 and req.num_computed == len(req.token_ids) - 1


def _root(req: SimRequest) -> bytes:
    """What a request's chain starts from: its adapter's name and its cache salt, so that
    requests that must not share cache never share a hash (vLLM folds both into the block
    hashes' extra keys)."""
    lora = None if req.lora is None else req.lora.name
    return b"kvgate-sim" + msgspec.json.encode([lora, req.cache_salt])
