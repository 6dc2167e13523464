"""Tokenization: chat templates, exact token ids, the incremental prefix cache, fallbacks."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvgate.index.api import PromptInput
from kvgate.index.config import IndexConfig
from kvgate.index.errors import TemplateError
from kvgate.index.keys import ChatTemplate, ModelTokenizer, block_keys, cache_seed
from kvgate.index.service import KvIndexService

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system", "hello", "world", "how", "are", "you", "fine", "tool"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def main():\n    return {'key': [1, 2, 3]}\n",
    "hello world, how are you? I am fine, thank you!",
    "Agents call tools: read_file(path='/tmp/x.py') and answer.",
    "ünïcödé text — with dashes… and numbers 12345 67890",
]


def write_config(directory: Path, template: str, **extra: Any) -> None:
    config = {
        "chat_template": template,
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|im_end|>"},
        **extra,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def word_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordLevel tokenizer with hand-assigned ids: exact sequences can be asserted."""
    directory = tmp_path_factory.mktemp("word")
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)  # ids 11, 12, 13
    tokenizer.save(str(directory / "tokenizer.json"))
    write_config(directory, CHATML)
    return directory


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained on a tiny corpus (GPT/Qwen style) with a BOS post-processor."""
    directory = tmp_path_factory.mktemp("bpe")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    write_config(directory, CHATML)
    return directory


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SentencePiece-like: Metaspace pre-tokenizer prepending '▁' to the first piece only."""
    directory = tmp_path_factory.mktemp("metaspace")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS])
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    write_config(directory, CHATML)
    return directory


def chat(*turns: tuple[str, str]) -> PromptInput:
    return PromptInput("chat", messages=[{"role": r, "content": c} for r, c in turns])


# ----------------------------------------------------------------- chat templates
def test_chatml_renders_exact_token_ids(word_dir: Path) -> None:
    tokenizer = ModelTokenizer(word_dir, 100_000, 8_000)
    text = tokenizer.render(chat(("user", "hello world"), ("assistant", "fine")))
    assert text == (
        "<|im_start|>user\nhello world<|im_end|>\n"
        "<|im_start|>assistant\nfine<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.encode_full(text, False) == [12, 1, 4, 5, 13, 12, 2, 9, 13, 12, 2]


@pytest.mark.anyio
async def test_service_tokenizer_mode_keys(word_dir: Path) -> None:
    async with httpx.AsyncClient() as http:
        config = IndexConfig(block_size=2, tokenizers={"m": word_dir})
        service = KvIndexService(config, CollectorRegistry(), http)
        await service.start()
        try:
            keys = await service.keys_for("m", chat(("user", "hello world how are you")))
        finally:
            await service.stop()
    ids = [12, 1, 4, 5, 6, 7, 8, 13, 12, 2]
    assert keys.mode == "tokenizer"
    assert keys.prompt_tokens == len(ids)
    assert list(keys.block_keys) == block_keys(ids, 2, cache_seed(None, None))


def test_template_features() -> None:
    source = (
        "{{ bos_token }}{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}"
        "{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.path }}{% endfor %}"
        "{% else %}{% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
        "{{ strftime_now('%Y') | length }}"
    )
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": None})
    assert template.content_format == "string"
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path": "/x"}'},
                }
            ],
        },
    ]
    tools = [{"type": "function", "function": {"name": "read"}}]
    text = template.render(messages, tools=tools, add_generation_prompt=True)
    assert text == (
        '<s>TOOLS=[{"type": "function", "function": {"name": "read"}}]\n'
        "user: a\nbCALL read /xassistant:4"  # trim_blocks eats the newline after a block tag
    )
    assert template.render(messages[:1], add_generation_prompt=False).endswith("user: a\nb4")
    with pytest.raises(TemplateError, match="bad role"):
        template.render([{"role": "bad", "content": "x"}])


def test_openai_content_format_keeps_parts() -> None:
    template = ChatTemplate(
        "{% for message in messages %}{% for part in message['content'] %}"
        "[{{ part.text }}]{% endfor %}{% endfor %}",
        {},
    )
    assert template.content_format == "openai"
    assert template.render([{"role": "user", "content": [{"type": "text", "text": "x"}]}]) == "[x]"


def test_sandbox_blocks_unsafe_access() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(TemplateError):
        template.render([{"role": "user", "content": "x"}])


# ------------------------------------------------------- incremental tokenization
def random_text(rng: random.Random, words: int) -> str:
    pieces = [rng.choice(CORPUS).split()[rng.randrange(4)] for _ in range(words)]
    separators = [" ", " ", "\n", "  ", ", ", "\n\n", "\t"]
    return "".join(p + rng.choice(separators) for p in pieces).strip()


@pytest.mark.anyio
@pytest.mark.parametrize("fixture", ["bpe_dir", "metaspace_dir", "word_dir"])
async def test_growing_session_equals_full_tokenization(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    directory: Path = request.getfixturevalue(fixture)
    tokenizer = ModelTokenizer(directory, 1_000_000, inline_chars=500)
    assert tokenizer.cache.enabled
    hits = await chat_session_hits(
        tokenizer, random.Random(7), random_text, turns=12, words=(30, 40, 20)
    )
    assert hits >= 10


async def chat_session_hits(
    tokenizer: ModelTokenizer,
    rng: random.Random,
    text_of: Callable[[random.Random, int], str],
    *,
    turns: int,
    words: tuple[int, int, int],
) -> int:
    """Grow a chat turn by turn (``words``: system, max user, max assistant), check every
    turn's tokens and keys against a full tokenization; return the prefix-cache hits."""
    system, user, assistant = words
    seed = cache_seed(None, None)
    messages: list[dict[str, str]] = [{"role": "system", "content": text_of(rng, system)}]
    hits = 0
    for _turn in range(turns):
        messages.append({"role": "user", "content": text_of(rng, rng.randrange(1, user))})
        text = tokenizer.render(PromptInput("chat", messages=list(messages)))
        result = await tokenizer.tokenize(text, add_special_tokens=False, block_size=4, seed=seed)
        full = tokenizer.encode_full(text, False)
        assert result.token_count == len(full)
        assert result.keys == block_keys(full, 4, seed)
        hits += result.cache_hit
        messages.append({"role": "assistant", "content": text_of(rng, rng.randrange(assistant))})
    return hits


@pytest.mark.anyio
async def test_completion_prompts_get_bos_like_the_engine(bpe_dir: Path) -> None:
    tokenizer = ModelTokenizer(bpe_dir, 1_000_000, 8_000)
    seed = cache_seed(None, "salt")
    for text in ("hello world", "hello world, how are you?<|im_end|> fine"):
        result = await tokenizer.tokenize(text, add_special_tokens=True, block_size=2, seed=seed)
        full = tokenizer.encode_full(text, True)
        assert full[0] == 0
        assert result.keys == block_keys(full, 2, seed)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_prefix_cache_exact_on_random_edits(bpe_dir: Path, data: st.DataObject) -> None:
    """Any sequence of texts (shared prefixes, edits, branches) tokenizes like a full pass."""
    tokenizer = ModelTokenizer(bpe_dir, budget_tokens(data), 8_000)
    alphabet = st.sampled_from(
        ["a", "b", " ", "\n", "é", "<|im_start|>", "<|im_end|>", "hello", "  ", "12", "<|im_", "|>"]
    )
    pieces = st.lists(alphabet, max_size=30).map("".join)
    texts = data.draw(st.lists(pieces, min_size=1, max_size=6))
    base = ""
    for extra in texts:
        base = (base + extra) if data.draw(st.booleans()) else base[: len(base) // 2] + extra
        result = asyncio.run(
            tokenizer.tokenize(base, add_special_tokens=False, block_size=3, seed=1)
        )
        assert result.keys == block_keys(tokenizer.encode_full(base, False), 3, 1)


def budget_tokens(data: st.DataObject) -> int:
    return data.draw(st.sampled_from([0, 20, 1_000_000]))


# ---------------------------------------------------------------------- fallbacks
@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.mark.anyio
async def test_token_ids_and_approx_modes(http: httpx.AsyncClient) -> None:
    registry = CollectorRegistry()
    service = KvIndexService(IndexConfig(block_size=4, approx_chars_per_block=8), registry, http)
    await service.start()
    try:
        ids = await service.keys_for("m", PromptInput("completion", prompt=list(range(10))))
        assert ids.mode == "token_ids"
        assert list(ids.block_keys) == block_keys(list(range(10)), 4, cache_seed(None, None))
        approx = await service.keys_for("m", chat(("user", "x" * 100)))
        assert approx.mode == "approx"
        assert len(approx.block_keys) == len("<|user|>\n" + "x" * 100 + "\n") // 8
        salted = await service.keys_for(
            "m", PromptInput("completion", prompt=list(range(10)), cache_salt="s")
        )
        assert not set(salted.block_keys) & set(ids.block_keys)
    finally:
        await service.stop()
    assert registry.get_sample_value("kvgate_tokenize_total", {"model": "m", "mode": "approx"}) == 1
