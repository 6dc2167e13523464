"""Prompt → tokens → block keys, exactly as the engine tokenizes when a tokenizer is configured.

Modes, best first (the one used is returned in ``PromptKeys.mode`` and counted):

* ``token_ids``: a completion prompt given as token ids is used as is;
* ``tokenizer``: the model's ``tokenizer.json`` and chat template (``ModelTokenizer``);
* ``engine``: the engine's own ``POST /tokenize`` (vLLM) through the shared HTTP client;
* ``approx``: the rendered text hashed in fixed character chunks (no tokens).

Chat prompts are tokenized without the post-processor's special tokens (the template writes
them), completion prompts with them, as vLLM does. Long cold tokenizations run in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from index.api import PromptInput
from index.blocks import block_keys, cache_seed
from index.chat_template import ChatTemplate, TemplateError, load_template_source
from index.prefix_cache import Cut, Entry, Plan, PrefixTokenCache, cuts_in
from index.types import BlockKey

log = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_TAIL_MEMO_CHARS = 256  # tails this short are remembered (tokens and cut points)
_TAIL_MEMO_ENTRIES = 1024


class TokenizeError(ValueError):
    """The prompt cannot be tokenized (bad template input, ids out of range...)."""


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    token_count: int
    keys: list[BlockKey]
    cache_hit: bool


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _safe_added_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Added tokens that split text into independently tokenized pieces (see prefix_cache)."""
    added = tokenizer.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    safe: dict[str, int] = {}
    for token_id, token in added.items():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            continue
        if not token.content or any(
            other != token.content and token.content in other for other in contents
        ):
            continue
        safe[token.content] = token_id
    return safe


def _probe_split(tokenizer: Tokenizer, safe: dict[str, int]) -> bool:
    """Check on sample texts that cutting before each safe token is exact."""
    samples = ("Hello world, it's 42!", " leading space", "ünïcödé\n\n  x", "a")
    for token in list(safe)[:8]:
        for left in samples:
            for right in samples:
                text = f"{left}{token}{right}{token}{left}"
                whole = tokenizer.encode(text, add_special_tokens=False).ids
                cut = text.index(token, len(left))
                head = tokenizer.encode(text[:cut], add_special_tokens=False).ids
                tail = tokenizer.encode(text[cut:], add_special_tokens=False).ids
                if head + tail != whole:
                    return False
    return True


class ModelTokenizer:
    """One model's tokenizer, chat template and rendered-prefix tokenization cache."""

    def __init__(self, directory: Path, cache_tokens: int, inline_chars: int) -> None:
        self.directory = directory
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = self._read_config(directory)
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        source = load_template_source(config)
        template_file = directory / "chat_template.jinja"
        if source is None and template_file.is_file():
            source = template_file.read_text()
        self.template = ChatTemplate(source, special) if source is not None else None
        safe = _safe_added_tokens(self.tokenizer)
        if safe and not _probe_split(self.tokenizer, safe):
            log.warning("%s: tokenizer splits unexpectedly; prefix cache disabled", directory)
            safe = {}
        self.cache = PrefixTokenCache(safe, cache_tokens)
        self._inline_chars = inline_chars
        self._affix = self._special_affix()
        self._tails: dict[str, tuple[array[int], list[Cut]]] = {}

    @staticmethod
    def _read_config(directory: Path) -> dict[str, Any]:
        path = directory / "tokenizer_config.json"
        if not path.is_file():
            return {}
        loaded = json.loads(path.read_text())
        return loaded if isinstance(loaded, dict) else {}

    def _special_affix(self) -> tuple[list[int], list[int]] | None:
        """Tokens the post-processor puts around a text, if it only adds a fixed prefix/suffix."""
        affixes = []
        for probe in ("probe text one", "x"):
            plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
            full = self.tokenizer.encode(probe, add_special_tokens=True).ids
            for start in range(len(full) - len(plain) + 1):
                if full[start : start + len(plain)] == plain:
                    affixes.append((full[:start], full[start + len(plain) :]))
                    break
            else:
                return None
        return affixes[0] if affixes[0] == affixes[1] else None

    def render(self, prompt: PromptInput) -> str:
        if self.template is None:
            raise TokenizeError(f"{self.directory}: no chat template")
        try:
            return self.template.render(
                prompt.messages or [],
                tools=prompt.tools,
                add_generation_prompt=prompt.add_generation_prompt,
                extra=prompt.chat_template_kwargs,
            )
        except TemplateError as error:
            raise TokenizeError(str(error)) from error

    def encode_full(self, text: str, add_special_tokens: bool) -> list[int]:
        """Reference tokenization (no cache)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _encode_tail(self, text: str) -> tuple[array[int], list[Cut]]:
        """Tokens of a text's uncached tail and its cut points (relative to the tail).

        Short tails repeat (the generation prompt after a cached conversation): they are
        remembered, as the tail is tokenized on its own (see index/prefix_cache.py).
        """
        short = len(text) <= _TAIL_MEMO_CHARS
        if short:
            found = self._tails.get(text)
            if found is not None:
                return found
        encoding: Encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids
        cuts = cuts_in(ids, self.cache.safe_ids, encoding.token_to_chars)  # type: ignore[arg-type]
        encoded = array("I", ids), cuts
        if short:
            if len(self._tails) >= _TAIL_MEMO_ENTRIES:
                self._tails.clear()
            self._tails[text] = encoded  # shared: callers only read them
        return encoded

    async def tokenize(
        self, text: str, *, add_special_tokens: bool, block_size: int, seed: int
    ) -> TokenizedPrompt:
        """Tokens of ``text`` (reusing a cached prefix) and their block keys."""
        plan = self.cache.plan(text)
        tail = text[plan.start :]
        if len(tail) > self._inline_chars:
            tail_ids, tail_cuts = await asyncio.to_thread(self._encode_tail, tail)
        else:
            tail_ids, tail_cuts = self._encode_tail(tail)
        entry = self.cache.commit(text, plan, tail_ids, tail_cuts)
        ids = entry.ids
        if add_special_tokens:
            if self._affix is None:
                full = self.encode_full(text, True)
                return TokenizedPrompt(len(full), block_keys(full, block_size, seed), False)
            before, after = self._affix
            ids = array("I", before) + ids + array("I", after)
            return TokenizedPrompt(len(ids), block_keys(ids, block_size, seed), False)
        reused, fresh, parent = self._reusable_keys(entry, plan, block_size, seed)
        if len(fresh) > self._inline_chars:  # ~ a few ms of hashing: off the event loop
            new = await asyncio.to_thread(block_keys, fresh, block_size, seed, parent)
        else:
            new = block_keys(fresh, block_size, seed, parent)
        keys = reused + new
        entry.keys = keys
        entry.keys_for = (seed, block_size)
        return TokenizedPrompt(len(ids), keys, plan.entry is not None)

    @staticmethod
    def _reusable_keys(
        entry: Entry, plan: Plan, block_size: int, seed: int
    ) -> tuple[list[BlockKey], array[int], BlockKey | None]:
        """The cached prefix's keys, the ids still to key, and the key before them."""
        reused: list[BlockKey] = []
        previous = plan.entry
        if previous is not None and previous.keys_for == (seed, block_size):
            reused = previous.keys[: len(plan.prefix) // block_size]
        start = len(reused) * block_size
        parent = reused[-1] if reused else None
        return reused, entry.ids[start:], parent


def prompt_seed(prompt: PromptInput) -> int:
    return cache_seed(prompt.lora_name, prompt.cache_salt)


def plain_render(prompt: PromptInput) -> str:
    """Text of a prompt for the approximate mode (no template known)."""
    if prompt.kind == "completion":
        return prompt.prompt if isinstance(prompt.prompt, str) else ""
    parts = []
    for message in prompt.messages or []:
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<|{message.get('role', '')}|>\n{content or ''}\n")
    if prompt.tools:
        parts.insert(0, json.dumps(list(prompt.tools), sort_keys=True))
    return "".join(parts)
