"""Incremental tokenization of plain text at space cut points (index/prefix_cache.py): exact
against full tokenization, only for pipelines that provably never merge across a space."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_support import shared_tokenizer
from test_tokenize_chat import chat_session_hits
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

import kvgate.index.keys._prefix_cache as prefix_cache
from kvgate.backends.sim.vocab import generated_word
from kvgate.index.keys import ModelTokenizer, block_keys, space_cuts_provable

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def main():\n    return {'key': [1, 2, 3]}\n",
    "hello world, how are you? I'm fine, thank you!\n\n",
    "Agents call tools: read_file(path='/tmp/x.py') and answer.",
    "ünïcödé text — with dashes… and numbers 12345 67890",
]
FRAGMENTS = [
    "hello",
    "world",
    "Ünïcödé",
    "café",
    "ΣΑΣ",
    "数字",
    "😀",
    "e\u0301",
    "\u00a8",
    "x\u00a0y",
    "42",
    "3.14",
    "12345",
    ",",
    ".",
    "!?",
    "'s",
    "I'm",
    "(a)",
    "-",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " \t ",
    "\r\n",
    "\u3000",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
]


def save(tokenizer: Tokenizer, directory: Path) -> Path:
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def trained_bpe(pre_tokenizer: Any, normalizer: Any = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def word_level(pre_tokenizer: Any) -> Tokenizer:
    words = sorted({w for line in CORPUS for w in line.split()})
    tokenizer = Tokenizer(
        models.WordLevel({"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}, "[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


def gpt2_style() -> Tokenizer:
    return trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))


def llama3_style() -> Tokenizer:
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
    return trained_bpe(
        pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)]),
        normalizers.NFC(),
    )


def bert_style() -> Tokenizer:
    tokenizer = word_level(pre_tokenizers.BertPreTokenizer())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    return tokenizer


def metaspace_style() -> Tokenizer:
    return trained_bpe(pre_tokenizers.Metaspace(prepend_scheme="first"))


def unknown_split_style() -> Tokenizer:
    split = pre_tokenizers.Split(Regex(r"\S+\s?"), behavior="isolated")
    return trained_bpe(pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)]))


def byte_level_nfkc() -> Tokenizer:
    return trained_bpe(pre_tokenizers.ByteLevel(), normalizers.NFKC())


def truncating() -> Tokenizer:
    tokenizer = word_level(pre_tokenizers.WhitespaceSplit())
    tokenizer.enable_truncation(64)
    return tokenizer


def replacing_normalizer() -> Tokenizer:
    tokenizer = word_level(pre_tokenizers.WhitespaceSplit())
    tokenizer.normalizer = normalizers.Replace(" ", "_")
    return tokenizer


SAFE_PIPELINES = {
    "gpt2": gpt2_style,
    "llama3": llama3_style,
    "bert": bert_style,
    "whitespace": lambda: word_level(pre_tokenizers.Whitespace()),
}
UNSAFE_PIPELINES = {
    "metaspace": metaspace_style,
    "unknown_split": unknown_split_style,
    "byte_level_nfkc": byte_level_nfkc,
    "truncating": truncating,
    "replace": replacing_normalizer,
}


@pytest.fixture(scope="module")
def sim_dir() -> Path:
    return shared_tokenizer().directory


@pytest.fixture(scope="module", params=sorted(SAFE_PIPELINES))
def safe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(SAFE_PIPELINES[request.param](), tmp_path_factory.mktemp(request.param))


@pytest.fixture
def small_gap() -> Iterator[None]:
    """Cut points every few characters, so that short texts exercise many of them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_cache, "MIN_GAP_CHARS", 6)
        patch.setattr(prefix_cache, "SPACE_GAP_CHARS", 9)
        yield


def random_text(rng: random.Random, fragments: int) -> str:
    pieces = []
    for _ in range(fragments):
        if rng.random() < 0.5:
            pieces.append(generated_word(rng.randrange(20_000)))
        else:
            pieces.append(rng.choice(FRAGMENTS))
        pieces.append(rng.choice([" ", " ", " ", "", "\n"]))
    return "".join(pieces)


def tokenize(tokenizer: ModelTokenizer, text: str, *, special: bool) -> tuple[int, list[int]]:
    result = asyncio.run(tokenizer.tokenize(text, add_special_tokens=special, block_size=3, seed=5))
    return result.token_count, result.keys


def assert_exact(tokenizer: ModelTokenizer, text: str, *, special: bool) -> None:
    count, keys = tokenize(tokenizer, text, special=special)
    full = tokenizer.encode_full(text, special)
    assert count == len(full)
    assert keys == block_keys(full, 3, 5)


# ------------------------------------------------------------------ which pipelines
def test_simulator_tokenizer_gets_space_cuts(sim_dir: Path) -> None:
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    assert tokenizer.cache.space_cuts and tokenizer.cache.enabled


def test_safe_pipelines_get_space_cuts(safe_dir: Path) -> None:
    assert ModelTokenizer(safe_dir, 1_000_000, 8_000).cache.space_cuts


@pytest.mark.parametrize("name", sorted(UNSAFE_PIPELINES))
def test_unprovable_pipelines_get_no_space_cuts(name: str, tmp_path: Path) -> None:
    built = UNSAFE_PIPELINES[name]()
    assert not space_cuts_provable(json.loads(built.to_str()))
    tokenizer = ModelTokenizer(save(built, tmp_path), 1_000_000, 8_000)
    assert not tokenizer.cache.space_cuts
    text = random_text(random.Random(3), 400).replace("<|im_", "")
    assert not any(space for _, _, space in tokenizer.cache.plan(text).marks)
    assert_exact(tokenizer, text, special=False)


def test_added_token_absorbing_spaces_disables_space_cuts(tmp_path: Path) -> None:
    built = gpt2_style()
    built.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert space_cuts_provable(json.loads(built.to_str()))
    assert not ModelTokenizer(save(built, tmp_path), 1_000_000, 8_000).cache.space_cuts


def test_cut_rule_reads_sequences_and_models() -> None:
    sim = json.loads(
        Tokenizer.from_file(str(shared_tokenizer().directory / "tokenizer.json")).to_str()
    )
    assert space_cuts_provable(sim)
    assert not space_cuts_provable(sim | {"normalizer": {"type": "Prepend", "prepend": "_"}})
    assert not space_cuts_provable(sim | {"pre_tokenizer": {"type": "Punctuation"}})
    assert not space_cuts_provable(sim | {"model": {"type": "BPE", "dropout": 0.1}})
    nested = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}]}],
    }
    assert space_cuts_provable(sim | {"pre_tokenizer": nested})


# ------------------------------------------------------------------ exactness
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sim_growing_texts_equal_full_tokenization(
    sim_dir: Path, small_gap: None, data: st.DataObject
) -> None:
    """Any sequence of grown, cut or edited texts tokenizes like a full pass."""
    tokenizer = ModelTokenizer(sim_dir, data.draw(st.sampled_from([50, 1_000_000])), 64)
    fragment = st.one_of(
        st.sampled_from(FRAGMENTS),
        st.integers(0, 19_999).map(generated_word),
        st.text(max_size=4),
    )
    chunk = st.lists(fragment, max_size=25).map("".join)
    text = ""
    for extra in data.draw(st.lists(chunk, min_size=1, max_size=6)):
        how = data.draw(st.sampled_from(["grow", "grow", "cut", "repeat"]))
        if how == "grow":
            text += extra
        elif how == "cut":
            text = text[: data.draw(st.integers(0, len(text)))] + extra
        assert_exact(tokenizer, text, special=data.draw(st.booleans()))


@pytest.mark.parametrize("special", [False, True])
def test_growing_prompt_equals_full_tokenization(safe_dir: Path, special: bool) -> None:
    tokenizer = ModelTokenizer(safe_dir, 1_000_000, 500)
    rng = random.Random(11)
    text = random_text(rng, 600)
    for _turn in range(8):
        assert_exact(tokenizer, text, special=special)
        text += rng.choice(["", " ", "\n", "\t"]) + random_text(rng, rng.randrange(1, 300))
    assert tokenizer.cache.hits >= 7


def test_sim_random_whitespace_and_unicode(sim_dir: Path, small_gap: None) -> None:
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 500)
    rng = random.Random(5)
    for _ in range(30):
        text = random_text(rng, rng.randrange(1, 200))
        text = rng.choice(["", " ", "  ", "\n", "\t "]) + text + rng.choice(["", " ", "\n  "])
        assert_exact(tokenizer, text, special=rng.random() < 0.5)
        assert_exact(tokenizer, text + random_text(rng, 20), special=False)


# ------------------------------------------------------------------ cost
def test_selected_cut_points_depend_only_on_the_text_before(sim_dir: Path) -> None:
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    rng = random.Random(9)
    text = random_text(rng, 3_000)
    marks = tokenizer.cache.plan(text).marks
    assert len(marks) > 10
    gaps = prefix_cache.MIN_GAP_CHARS, prefix_cache.SPACE_GAP_CHARS
    tokens = [m for m in marks if not m[2]]
    assert tokens and len(tokens) < len(marks)
    assert all(b[0] - a[1] >= gaps[0] for a, b in itertools.pairwise(tokens))
    assert all(b[0] - a[1] >= gaps[1] for a, b in itertools.pairwise(marks) if b[2])
    for length in (0, 1, 700, 2_500, 5_000, len(text) // 2, len(text) - 1):
        prefix_marks = tokenizer.cache.plan(text[:length]).marks
        assert prefix_marks == [m for m in marks if m[1] <= length]


def test_repeated_and_grown_prompts_tokenize_only_their_tail(sim_dir: Path) -> None:
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 8_000)
    rng = random.Random(4)
    text = " ".join(generated_word(rng.randrange(20_000)) for _ in range(4_000))
    assert_exact(tokenizer, text, special=True)
    reach = prefix_cache.SPACE_GAP_CHARS + 64
    assert tokenizer.cache.plan(text).start > len(text) - reach
    grown = text + " " + " ".join(generated_word(rng.randrange(20_000)) for _ in range(50))
    assert tokenizer.cache.plan(grown).start > len(text) - reach
    assert_exact(tokenizer, grown, special=True)


# ------------------------------------------------------------------ chat prompts
@pytest.mark.anyio
async def test_sim_chat_session_equals_full_tokenization(sim_dir: Path) -> None:
    tokenizer = ModelTokenizer(sim_dir, 1_000_000, 500)
    hits = await chat_session_hits(
        tokenizer, random.Random(2), random_text, turns=10, words=(300, 200, 200)
    )
    assert hits >= 9
