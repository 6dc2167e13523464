"""The simulator's word-level tokenizer: files, one token per vocabulary word, no collapse of
unknown words, chunked encoding identical to ``tokenizer.json``, ChatML rendering."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_support import shared_tokenizer
from tokenizers import Tokenizer

from kvgate.backends.sim.english import english_words
from kvgate.backends.sim.tokenizer import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    SimTokenizer,
    split_chunks,
    tokenizer_dir,
)
from kvgate.backends.sim.vocab import GENERATED_WORDS, SPECIAL_TOKENS, generated_word, vocabulary
from kvgate.index.errors import TemplateError

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    return Tokenizer.from_file(str(shared_tokenizer().directory / TOKENIZER_FILE))


def test_tokenizer_dir_is_built_once_and_deterministic(tmp_path: Path) -> None:
    first = tokenizer_dir(tmp_path)
    second = tokenizer_dir(tmp_path)
    assert first == second
    assert sorted(p.name for p in first.iterdir()) == sorted([TOKENIZER_FILE, CONFIG_FILE])
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left behind
    config = json.loads((first / CONFIG_FILE).read_text())
    assert config["bos_token"] == "<s>" and config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in config["chat_template"]
    other = tokenizer_dir(tmp_path / "elsewhere")
    assert (other / TOKENIZER_FILE).read_bytes() == (first / TOKENIZER_FILE).read_bytes()


def test_vocabulary_layout() -> None:
    vocab = vocabulary()
    assert len(vocab) == len(set(vocab))
    assert vocab[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    assert vocab[-GENERATED_WORDS:] == tuple(generated_word(i) for i in range(GENERATED_WORDS))


def test_every_vocabulary_word_is_one_token(raw: Tokenizer) -> None:
    rng = random.Random(5)
    words = [generated_word(i) for i in (0, 1, GENERATED_WORDS - 1)]
    words += [generated_word(rng.randrange(GENERATED_WORDS)) for _ in range(3000)]
    words += list(english_words())
    encoded = raw.encode_batch(words, add_special_tokens=False)
    assert [len(e.ids) for e in encoded] == [1] * len(words)
    text = " ".join(words)
    assert len(raw.encode(text, add_special_tokens=False).ids) == len(words)


def test_unknown_words_are_spelled_not_collapsed(raw: Tokenizer) -> None:
    def ids(text: str) -> list[int]:
        return list(raw.encode(text, add_special_tokens=False).ids)

    unk = raw.token_to_id("<unk>")
    samples = ["kvgate", "kvgatf", "Llama-3.1-8B", "naïve café", "你好世界", "🙂 emoji", "x_y"]
    spelled = [ids(s) for s in samples]
    assert all(unk not in s for s in spelled)
    assert len({tuple(s) for s in spelled}) == len(samples)
    assert ids("Hello") == ids("hello")  # lowercased
    assert ids("x" * 101) == [unk]  # the one documented collapse: words over 100 characters


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["hello", "World", "<|im_start|>", "<|im_end|>", "2024", "naïve", "你好", "kvgate",
             "\n", " ", "  ", "\t", ",", "...", "x" * 120, generated_word(3), "don't"]
        ),
        max_size=3000,
    )
)  # fmt: skip
def test_chunked_encoding_equals_the_tokenizer_json(raw: Tokenizer, parts: list[str]) -> None:
    text = " ".join(parts)
    assert shared_tokenizer().encode(text) == raw.encode(text, add_special_tokens=False).ids


def test_split_chunks_cuts_at_whitespace_only() -> None:
    text = ("abc " * 3000) + "tail"
    chunks = split_chunks(text, chunk_chars=100)
    assert "".join(chunks) == text
    assert all(c[0] in " \n" for c in chunks[1:])
    assert split_chunks("x" * 500, chunk_chars=100) == ["x" * 500]


async def test_long_prompts_encode_the_same_in_a_thread(raw: Tokenizer) -> None:
    tok = SimTokenizer(shared_tokenizer().directory)
    rng = random.Random(9)
    text = " ".join(generated_word(rng.randrange(GENERATED_WORDS)) for _ in range(20_000))
    expected_ids = raw.encode(text, add_special_tokens=False).ids
    assert await tok.encode_async(text) == expected_ids
    grown = text + " and then some more words"
    assert tok.encode(grown) == raw.encode(grown, add_special_tokens=False).ids


def test_chatml_rendering() -> None:
    tok = shared_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert tok.render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("b<|im_end|>\n")
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    assert tok.render_chat(messages, tools=tools).startswith(
        '<|im_start|>system\n# Tools\n{"type": "function", "function": {"name": "lookup"}}\n'
    )
    partial = [*messages, {"role": "assistant", "content": "The answer is "}]
    continued = tok.render_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nThe answer is ")
    with pytest.raises(TemplateError):
        tok.render_chat(partial, add_generation_prompt=True, continue_final_message=True)
    ids = tok.encode(tok.render_chat(messages))
    assert [tok.token_text(i) for i in ids[:3]] == ["<|im_start|>", "system", "be"]
