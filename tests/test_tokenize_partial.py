"""A long new prompt is tokenized only as far as a worker's cached match can reach: exact keys
for that part, an estimated token count, and the whole text tokenized in the background for
the next turn (the simulator's tokenizer, which has exact space cut points)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_sim_support import shared_tokenizer

from kvgate.backends.sim.vocab import generated_word
from kvgate.index.keys import (
    PARTIAL_CHARS,
    WINDOW_CHARS,
    ModelTokenizer,
    TokenizedPrompt,
    block_keys,
)
from kvgate.index.service import KvIndexService
from kvgate.index.types import BlockKey

pytestmark = pytest.mark.anyio
BS = 16


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(generated_word(rng.randrange(32_000)) for _ in range(count))


@pytest.fixture
def sim_dir() -> Path:
    return shared_tokenizer().directory


class Holder:
    """A fleet whose workers hold the first ``held`` blocks of some chain (its keys)."""

    def __init__(self, chain: Sequence[BlockKey], held: int) -> None:
        self.chain = list(chain[:held])
        self.calls = 0

    def __call__(self, keys: Sequence[BlockKey]) -> int:
        self.calls += 1
        n = 0
        for mine, theirs in zip(self.chain, keys, strict=False):
            if mine != theirs:
                break
            n += 1
        return n


async def test_a_fresh_prompt_is_tokenized_only_as_far_as_a_match_reaches(sim_dir: Path) -> None:
    text = words(60_000, seed=1)  # ~400k characters, one token per word
    assert len(text) > 4 * PARTIAL_CHARS
    full = ModelTokenizer(sim_dir, 1_000_000, 8_000).encode_full(text, False)
    all_keys = block_keys(full, BS, 7)

    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    nobody = Holder(all_keys, held=0)
    partial = await tokenizer.tokenize(
        text, add_special_tokens=False, block_size=BS, seed=7, reach=nobody
    )
    assert nobody.calls == 1  # one window: its first block is held by nobody
    assert 0 < len(partial.keys) * BS <= WINDOW_CHARS  # words are several characters each
    assert partial.keys == all_keys[: len(partial.keys)]  # exact where computed
    assert partial.token_count == pytest.approx(len(full), rel=0.05)  # the rest estimated

    await tokenizer.drain()  # the whole text went into the prefix cache meanwhile
    again = await tokenizer.tokenize(text, add_special_tokens=False, block_size=BS, seed=7)
    assert again.cache_hit and again.keys == all_keys and again.token_count == len(full)


async def test_windows_continue_while_the_prefix_is_held(sim_dir: Path) -> None:
    shared = words(12_000, seed=2)  # a long shared prefix (a system prompt), held
    text = shared + " " + words(50_000, seed=3)
    full = ModelTokenizer(sim_dir, 1_000_000, 8_000).encode_full(text, False)
    all_keys = block_keys(full, BS, 0)
    held = len(shared.split()) // BS
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    partial = await tokenizer.tokenize(
        text, add_special_tokens=False, block_size=BS, seed=0, reach=Holder(all_keys, held)
    )
    assert held < len(partial.keys) < len(all_keys) // 2
    assert partial.keys == all_keys[: len(partial.keys)]
    await tokenizer.drain()


async def test_whole_text_when_a_worker_holds_most_of_it(sim_dir: Path) -> None:
    """Cached somewhere but not in this prefix cache (kvgate restarted): the windows stop at
    half the text and it is tokenized whole (keys exact, count exact, no background job)."""
    text = words(40_000, seed=4)
    full = ModelTokenizer(sim_dir, 1_000_000, 8_000).encode_full(text, False)
    await _assert_tokenized_whole(ModelTokenizer(sim_dir, 1_000_000, 8_000), text, full)


async def _assert_tokenized_whole(tokenizer: ModelTokenizer, text: str, full: list[int]) -> None:
    """A worker holds all of ``text`` (tokens ``full``): keys and count come out exact and
    no background job is left."""
    all_keys = block_keys(full, BS, 0)
    result = await tokenizer.tokenize(
        text, add_special_tokens=False, block_size=BS, seed=0, reach=Holder(all_keys, 10**9)
    )
    assert result.keys == all_keys and result.token_count == len(full)
    assert not tokenizer._background


async def test_completion_prompts_keep_their_special_tokens(sim_dir: Path) -> None:
    text = words(30_000, seed=5)
    reference = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    full = reference.encode_full(text, True)
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    partial = await tokenizer.tokenize(
        text, add_special_tokens=True, block_size=BS, seed=0, reach=lambda keys: 0
    )
    expected = block_keys(full, BS, 0)
    assert partial.keys == expected[: len(partial.keys)]
    assert partial.token_count == pytest.approx(len(full), rel=0.05)
    tokenizer.close()  # cancelled, not awaited: nothing is left behind
    await tokenizer.drain()


async def test_short_and_known_texts_take_the_exact_path(sim_dir: Path) -> None:
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    short = words(2_000, seed=6)
    result = await tokenizer.tokenize(
        short, add_special_tokens=False, block_size=BS, seed=0, reach=lambda keys: 0
    )
    assert result.token_count == len(tokenizer.encode_full(short, False))
    assert not tokenizer._background


async def test_the_index_service_keys_a_long_new_prompt_as_far_as_a_worker_holds_it(
    sim_dir: Path,
) -> None:
    """Wired end to end: the service's keyer asks the index's own matches how far some worker
    holds the prompt, and stopping the service cancels the background tokenization."""
    import httpx  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from kvgate.index.api import PromptInput, StoreBlocks  # noqa: PLC0415
    from kvgate.index.config import IndexConfig  # noqa: PLC0415
    from kvgate.index.keys import prompt_seed  # noqa: PLC0415
    from kvgate.index.service import KvIndexService  # noqa: PLC0415
    from kvgate.index.types import WorkerId, WorkerKey  # noqa: PLC0415

    shared = words(12_000, seed=8)
    text = shared + " " + words(40_000, seed=9)
    prompt = PromptInput(kind="completion", prompt=text)
    config = IndexConfig(tokenizers={"m": sim_dir}, engine_tokenize=False)
    full = ModelTokenizer(sim_dir, 1_000_000, 8_000).encode_full(text, True)
    all_keys = block_keys(full, config.block_size_for("m"), prompt_seed(prompt))
    held = len(all_keys) // 8  # the shared prefix's first blocks, on one worker
    async with httpx.AsyncClient() as http:
        service = KvIndexService(config, CollectorRegistry(), http)
        await service.start()
        try:
            service.events.apply(WorkerKey(WorkerId("w1"), 0), StoreBlocks(all_keys[:held]))
            keys = await service.keys_for("m", prompt)
            assert keys.mode == "tokenizer"
            assert held < len(keys.block_keys) < len(all_keys) // 2  # stopped past the match
            assert list(keys.block_keys) == all_keys[: len(keys.block_keys)]
            assert service.match(keys.block_keys)[WorkerId("w1")].blocks == held
            assert keys.prompt_tokens == pytest.approx(len(full), rel=0.05)
            tokenizer = service._keyer.tokenizers["m"]
            assert tokenizer is not None
            assert not tokenizer._background  # left for after the request's first token
            assert keys.finish is not None
            keys.finish()
            keys.finish()  # once only
            jobs = set(tokenizer._background)
            assert len(jobs) == 1  # the whole text, for the next turn
        finally:
            await service.stop()
        await tokenizer.drain()  # cancelled by stop (or done just before): none left running
        assert all(job.done() for job in jobs) and not tokenizer._background


async def _with_history(
    sim_dir: Path, seed: int, new_words: int
) -> tuple[ModelTokenizer, TokenizedPrompt, str, list[int], list[BlockKey]]:
    """A tokenizer whose prefix cache holds a 6k-word history (seed ``seed``), that history's
    result, the history plus ``new_words`` fresh words (seed + 1), and that text's reference
    tokens and keys."""
    history = words(6_000, seed=seed)
    text = history + " " + words(new_words, seed=seed + 1)
    full = ModelTokenizer(sim_dir, 1_000_000, 8_000).encode_full(text, False)
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    first = await tokenizer.tokenize(history, add_special_tokens=False, block_size=BS, seed=0)
    return tokenizer, first, text, full, block_keys(full, BS, 0)


async def test_a_long_new_tail_after_a_cached_prefix_is_not_tokenized_when_nobody_holds_it(
    sim_dir: Path,
) -> None:
    """A turn that adds a long tool output to a conversation in the prefix cache: nobody holds
    the whole cached prefix, so no window of the new part is tokenized before the decision;
    the keys are the cached prefix's, the count an estimate, the turn completed later."""
    tokenizer, first, text, full, all_keys = await _with_history(sim_dir, 10, 20_000)
    held = len(first.keys) // 2  # the home worker evicted the history's second half
    holder = Holder(all_keys, held)
    grown = await tokenizer.tokenize(
        text, add_special_tokens=False, block_size=BS, seed=0, reach=holder
    )
    assert holder.calls == 1
    assert grown.cache_hit and grown.keys == all_keys[: len(grown.keys)]
    # the prefix cache's part only (it reuses a text up to its last selected cut point)
    assert held < len(grown.keys) <= len(first.keys)
    assert grown.token_count == pytest.approx(len(full), rel=0.05)

    await tokenizer.drain()
    again = await tokenizer.tokenize(text, add_special_tokens=False, block_size=BS, seed=0)
    assert again.keys == all_keys and again.token_count == len(full)


async def test_a_long_new_tail_is_tokenized_as_far_as_a_worker_holds_it(sim_dir: Path) -> None:
    """The same turn when a worker holds the history and part of the new text (another
    router instance routed it): windows of the new part continue past the held blocks."""
    tokenizer, first, text, full, all_keys = await _with_history(sim_dir, 12, 30_000)
    held = len(first.keys) + 200
    grown = await tokenizer.tokenize(
        text, add_special_tokens=False, block_size=BS, seed=0, reach=Holder(all_keys, held)
    )
    assert held < len(grown.keys) < len(all_keys) // 2
    assert grown.keys == all_keys[: len(grown.keys)]
    assert grown.token_count == pytest.approx(len(full), rel=0.05)
    await tokenizer.drain()


async def test_a_long_tail_held_past_half_is_tokenized_whole(sim_dir: Path) -> None:
    tokenizer, _, text, full, _ = await _with_history(sim_dir, 14, 20_000)
    await _assert_tokenized_whole(tokenizer, text, full)


async def test_the_rest_of_a_deferred_prompt_starts_only_when_asked(sim_dir: Path) -> None:
    text = words(20_000, seed=16)
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    partial = await tokenizer.tokenize(
        text, add_special_tokens=False, block_size=BS, seed=0, reach=lambda keys: 0, defer=True
    )
    assert partial.complete is not None and not tokenizer._background
    partial.complete()
    assert len(tokenizer._background) == 1
    await tokenizer.drain()
    again = await tokenizer.tokenize(text, add_special_tokens=False, block_size=BS, seed=0)
    assert again.cache_hit


async def test_kvgate_finishes_a_long_new_prompt_after_its_first_token(sim_dir: Path) -> None:
    """Through a real kvgate and a simulated replica: a long new prompt is keyed in part, and
    the proxy starts the rest once the answer begins, so the next turn finds it all in the
    prefix cache."""
    from fakes.gateway import kvgate  # noqa: PLC0415
    from test_sim_support import sim_config, sim_fleet  # noqa: PLC0415

    model = "kvgate-sim"
    text = words(8_000, seed=17)  # ~55k characters: keyed in part
    async with sim_fleet(sim_config(replicas=1, speedup=1000.0)) as fleet:
        worker = f"{fleet.replicas[0].url},models={model}"
        async with kvgate(
            [worker], policy="kv", tokenizers=[f"{model}={sim_dir}"], kv_index=True
        ) as gw:
            body = {"model": model, "prompt": text, "max_tokens": 2, "stream": True}
            async with gw.client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                async for _ in reply.aiter_bytes():
                    pass
            index = gw.gateway.index
            assert isinstance(index, KvIndexService)
            tokenizer = index._keyer.tokenizers[model]
            assert tokenizer is not None
            await tokenizer.drain()
            assert tokenizer.cache.plan(text).entry is not None  # the whole text, for next time
