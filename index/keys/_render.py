"""The engines' renderer as the authority for a prompt's tokens: the rendered-prompt cache and
the start-up self-check of the local template.

* ``RenderedPrompts``: the token ids an engine rendered (or tokenized) for a prompt, by engine
  kind, model and a digest of the request that was rendered, within a token budget (least
  recently used first out). A prompt keyed again (a retry, a queued request ranked again,
  ``/debug/route`` then the request, the same prompt sent twice) costs no engine call; a new
  turn of a conversation is a new prompt, rendered whole by the engine.
* ``PROBES`` and ``first_difference``: a few fixed chats (kvgate's own text, so any worker may
  read them: a system prompt, several turns, tools) rendered by the local template and by an
  engine serving the model; a difference means the local tokens would key prompts otherwise
  than the engine caches them.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from kvgate.index.api import PromptInput

RENDERED_BUDGET_TOKENS = 4_000_000
"""Token ids the rendered-prompt cache keeps (4 bytes each: 16 MB)."""

_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PROBES: tuple[PromptInput, ...] = (
    PromptInput(kind="chat", messages=[{"role": "user", "content": "Hello, how are you today?"}]),
    PromptInput(
        kind="chat",
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And three plus three?"},
        ],
    ),
    PromptInput(
        kind="chat",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[_WEATHER_TOOL],
    ),
)
"""The self-check's prompts: one turn, several turns with a system prompt, a tool offered."""


def render_digest(kind: str, model: str, body: dict[str, Any]) -> bytes:
    """The cache key of one rendering request: engine kind, model and the request itself."""
    encoded = msgspec.json.encode(body, order="deterministic")
    return xxhash.xxh3_128_digest(kind.encode() + b"\x00" + model.encode() + b"\x00" + encoded)


class RenderedPrompts:
    """Rendered token ids by request digest, at most ``budget_tokens`` of them in all."""

    def __init__(self, budget_tokens: int = RENDERED_BUDGET_TOKENS) -> None:
        self._budget = budget_tokens
        self._tokens = 0
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, digest: bytes) -> list[int] | None:
        found = self._entries.get(digest)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.hits += 1
        return found.tolist()

    def put(self, digest: bytes, ids: Sequence[int]) -> None:
        """Remember ``ids`` (a prompt longer than the budget is not kept)."""
        if len(ids) > self._budget or digest in self._entries:
            return
        self._entries[digest] = array("I", ids)
        self._tokens += len(ids)
        while self._tokens > self._budget:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= len(dropped)

    def __len__(self) -> int:
        return len(self._entries)


def first_difference(local: Sequence[int], engine: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (None: equal)."""
    for position, (a, b) in enumerate(zip(local, engine, strict=False)):
        if a != b:
            return position
    return None if len(local) == len(engine) else min(len(local), len(engine))
