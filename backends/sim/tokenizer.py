"""The simulator's tokenizer: a Hugging Face ``tokenizer.json`` built from ``vocab.py``.

Design (see docs/simulator.md):

* Model: WordPiece over ``vocabulary()``. Every vocabulary word (chat roles, common English,
  every generated trace word) is exactly one token; any other word is spelled greedily as a
  vocabulary prefix plus ``##`` continuation pieces, down to single bytes, so unknown words
  never collapse onto one id. Only a word longer than 100 characters becomes ``<unk>``.
* Normalizer: NFKD, strip accents, lowercase. Pre-tokenizer: split on whitespace, isolate
  each punctuation character and each digit, then map bytes to printable characters
  (GPT-2 byte-level alphabet) so non-Latin text is spelled in byte pieces.
* Special tokens ``<unk> <s> </s> <|im_start|> <|im_end|>`` are matched in the raw text.
* ``tokenizer_config.json`` carries the ChatML chat template and the bos/eos tokens.

``tokenizer_dir()`` writes both files once, deterministically, into a cache directory named
after their content hash, so the simulator and ``kvgate serve --sim`` load the same files.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import tempfile
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvgate.backends.sim.template import CHAT_TEMPLATE, cut_after_final_message
from kvgate.backends.sim.vocab import (
    CONTINUATION_PREFIX,
    SPECIAL_TOKENS,
    generated_word,
    vocabulary,
)
from kvgate.index.errors import TemplateError
from kvgate.index.keys import ChatTemplate

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
BOS_TOKEN = "<s>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
MAX_WORD_CHARS = 100
"""Longer words become ``<unk>`` (WordPiece's ``max_input_chars_per_word``)."""


def build_tokenizer() -> Tokenizer:
    """The simulator's tokenizer, built from the vocabulary (deterministic)."""
    vocab = {word: i for i, word in enumerate(vocabulary())}
    tok = Tokenizer(
        models.WordPiece(
            vocab=vocab,
            unk_token=UNK_TOKEN,
            continuing_subword_prefix=CONTINUATION_PREFIX,
            max_input_chars_per_word=MAX_WORD_CHARS,
        )
    )
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Punctuation(behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config(model_max_length: int = 131_072) -> dict[str, Any]:
    """``tokenizer_config.json`` contents: chat template, special tokens, no BOS added."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": UNK_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "normalized": False}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


@cache
def _tokenizer_files() -> tuple[tuple[str, str], ...]:
    """(file name, content) of the tokenizer directory, built once per process."""
    return (
        (TOKENIZER_FILE, build_tokenizer().to_str()),
        (CONFIG_FILE, json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n"),
    )


def _default_cache_root() -> Path:
    explicit = os.environ.get("KVGATE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvgate"


def tokenizer_dir(cache_root: Path | None = None) -> Path:
    """A directory holding the simulator's ``tokenizer.json`` and ``tokenizer_config.json``.

    Built on first use under ``cache_root`` (default ``$KVGATE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvgate`` or ``~/.cache/kvgate``) in a directory named after the
    files' content hash; concurrent callers are safe (atomic rename). Blocking file I/O:
    call it at start-up, not in a request path.
    """
    files = _tokenizer_files()
    digest = hashlib.sha256()
    for name, content in files:
        digest.update(name.encode() + b"\0" + content.encode() + b"\0")
    root = cache_root if cache_root is not None else _default_cache_root()
    target = root / f"sim-tokenizer-{digest.hexdigest()[:16]}"
    if all((target / name).is_file() for name, _ in files):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sim-tokenizer-", dir=root))
    try:
        for name, content in files:
            (staging / name).write_text(content, encoding="utf-8")
        try:
            staging.rename(target)
        except OSError:
            if not all((target / name).is_file() for name, _ in files):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_CHUNK_CHARS = 4096
"""Long texts are cut at the first space or newline after every 4 KiB and tokenized per
chunk, with a cache: cutting at whitespace never changes the tokens, and a growing prompt
(agent history) re-tokenizes only its new tail."""
_CACHE_TOKENS = 8_000_000
"""Bound of the chunk cache, in cached token ids (4 bytes each)."""
_CACHE_ENTRIES = 65_536
"""Bound of the chunk cache, in chunks."""
_THREAD_CHARS = 32_768
"""Uncached text longer than this is tokenized in a worker thread (the library releases the
GIL in batch encoding), so a long prompt never stalls the event loop."""


def split_chunks(text: str, chunk_chars: int = _CHUNK_CHARS) -> list[str]:
    """Cut ``text`` after roughly every ``chunk_chars`` characters, at a space or newline.

    Cut points depend only on the text before them, so two texts with a common prefix share
    their leading chunks. Special tokens contain no whitespace and are never cut.
    """
    chunks: list[str] = []
    start = 0
    while len(text) - start > chunk_chars:
        cut = _next_space(text, start + chunk_chars)
        if cut < 0:
            break
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def _next_space(text: str, at: int) -> int:
    space, newline = text.find(" ", at), text.find("\n", at)
    if space < 0 or newline < 0:
        return max(space, newline)
    return min(space, newline)


class SimTokenizer:
    """Tokenization and chat rendering exactly as the simulated engine does them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tok = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        self._template = ChatTemplate(
            config["chat_template"],
            {name: config[name] for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        )
        self._special_ids = {t: self._token_id(t) for t in SPECIAL_TOKENS}
        self._words = tuple(self._tok.id_to_token(i) or "" for i in range(self.vocab_size))
        self.first_generated_id = self._token_id(generated_word(0))
        self._chunks: OrderedDict[str, array[int]] = OrderedDict()
        self._cached_tokens = 0

    @classmethod
    def default(cls) -> SimTokenizer:
        """The tokenizer from ``tokenizer_dir()`` (blocking: call at start-up)."""
        return cls(tokenizer_dir())

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def _token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"token {token!r} missing from the tokenizer")
        return int(tid)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (``##`` pieces keep their prefix)."""
        return self._words[token_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat request (raises ``TemplateError``).

        Rendered by ``index.chat_template`` (vLLM's message preparation, Hugging Face's
        template semantics); ``continue_final_message`` cuts as ``transformers`` does.
        """
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt are exclusive")
        text = self._template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            extra=template_kwargs,
        )  # fmt: skip
        return cut_after_final_message(text, messages) if continue_final_message else text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (identical to ``tokenizer.json``'s ``encode``), on this thread."""
        pieces = self._pieces(text)
        missing = [p for p in pieces if p not in self._special_ids and p not in self._chunks]
        if missing:
            self._store(missing, self._tok.encode_batch(missing, add_special_tokens=False))
        return self._assemble(pieces)

    async def encode_async(self, text: str) -> list[int]:
        """Like ``encode``; long uncached text is tokenized in a worker thread."""
        pieces = self._pieces(text)
        missing = [p for p in pieces if p not in self._special_ids and p not in self._chunks]
        if missing:
            if sum(map(len, missing)) > _THREAD_CHARS:
                encodings = await asyncio.to_thread(
                    self._tok.encode_batch, missing, add_special_tokens=False
                )
            else:
                encodings = self._tok.encode_batch(missing, add_special_tokens=False)
            self._store(missing, encodings)
        return self._assemble(pieces)

    def _pieces(self, text: str) -> list[str]:
        pieces: list[str] = []
        for segment in _SPECIAL_SPLIT.split(text):
            if segment in self._special_ids:
                pieces.append(segment)
            elif segment:
                pieces.extend(split_chunks(segment))
        return pieces

    def _store(self, pieces: list[str], encodings: list[Any]) -> None:
        for piece, encoding in zip(pieces, encodings, strict=True):
            if piece in self._chunks:
                continue
            ids = array("i", encoding.ids)
            self._chunks[piece] = ids
            self._cached_tokens += len(ids)
        while self._chunks and (
            self._cached_tokens > _CACHE_TOKENS or len(self._chunks) > _CACHE_ENTRIES
        ):
            _, dropped = self._chunks.popitem(last=False)
            self._cached_tokens -= len(dropped)

    def _assemble(self, pieces: list[str]) -> list[int]:
        out: list[int] = []
        for piece in pieces:
            special = self._special_ids.get(piece)
            if special is not None:
                out.append(special)
                continue
            ids = self._chunks.get(piece)
            if ids is None:  # evicted between store and assemble by a huge prompt
                ids = array("i", self._tok.encode(piece, add_special_tokens=False).ids)
            else:
                self._chunks.move_to_end(piece)
            out.extend(ids)
        return out
