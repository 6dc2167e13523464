"""Which workers may tokenize a prompt that has no local tokenizer: only workers the request
may be routed to, its likeliest destination first (issue 44, finding 13). Pure: no I/O.

The engine ``/tokenize`` fallback (index/keys/_engine.py) hands a worker the whole prompt, and
its tokens key the prompt for every worker. So the workers asked are the request's candidates
(ready, serving its model; the pinned one alone when a conversation is pinned to a worker), in
this order:

1. the worker this conversation's last engine-tokenized request was sent to: its cache holds
   the conversation, so the cost policy sends the next turn there too (under session traffic
   the tokenizing worker is the chosen one);
2. the others by rendezvous hash of the conversation's key: its session key (``x-session-id``,
   else ``user``) hashed as the router's tie-break hashes it (a new session's first turn, costs
   tied, goes where it was tokenized), else the prompt's opening (the messages up to the first
   user turn, or the first characters of a completion prompt), the same on every turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import xxhash

from kvgate.backends.registry import WorkerRegistry
from kvgate.index.api import PromptInput
from kvgate.index.memo import BoundedMemo
from kvgate.index.types import WorkerId
from kvgate.scoring.api import RouteRequest
from kvgate.scoring.tiebreak import rendezvous_weight, session_hash_key

REMEMBERED_CONVERSATIONS = 65_536
"""Conversations whose last worker is remembered (about 100 bytes each)."""
_OPENING_CHARS = 4096  # of a prompt's opening hashed into its conversation key
_OPENING_MESSAGES = 16  # messages read for it at most


def conversation_key(model: str, prompt: PromptInput, session_key: str | None) -> bytes:
    """The key of the conversation a request belongs to (see the module's note)."""
    if session_key:
        return session_hash_key(RouteRequest(model=model, session_key=session_key))
    return b"opening\x00" + xxhash.xxh3_128_digest(_opening(prompt))


def _opening(prompt: PromptInput) -> bytes:
    """A chat's messages up to its first user turn, or a completion prompt's first
    characters: what every turn of one conversation starts with."""
    if prompt.kind == "completion":
        text = prompt.prompt if isinstance(prompt.prompt, str) else ""
        return text[:_OPENING_CHARS].encode("utf-8", "surrogatepass")
    parts: list[bytes] = []
    size = 0
    for message in list(prompt.messages or ())[:_OPENING_MESSAGES]:
        part = _message_bytes(message)
        parts.append(part[: _OPENING_CHARS - size])
        size += len(parts[-1])
        if message.get("role") == "user" or size >= _OPENING_CHARS:
            break
    return b"\x00".join(parts)


def _message_bytes(message: Mapping[str, Any]) -> bytes:
    content = message.get("content")
    try:
        body = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else b""
        if not body and content is not None:
            body = msgspec.json.encode(content)
    except (TypeError, ValueError, RecursionError):
        body = b""
    return str(message.get("role")).encode("utf-8", "surrogatepass") + b"\x00" + body


class TokenizeOn:
    """The workers that may tokenize one request's prompt, likeliest destination first
    (``index.api.TokenizeOn``); computed when the index calls it (a prompt keyed by a local
    tokenizer costs nothing here)."""

    __slots__ = ("_model", "_only", "_planner", "_prompt", "_session", "key")

    def __init__(
        self,
        planner: TokenizePlanner,
        model: str,
        prompt: PromptInput,
        session_key: str | None,
        only: WorkerId | None,
    ) -> None:
        self._planner = planner
        self._model = model
        self._prompt = prompt
        self._session = session_key
        self._only = only
        self.key: bytes | None = None
        """The conversation's key, once called: the request was tokenized by an engine."""

    def __call__(self) -> Sequence[WorkerId]:
        self.key = conversation_key(self._model, self._prompt, self._session)
        return self._planner.order(self._model, self.key, self._only)


class TokenizePlanner:
    """Remembers each conversation's last worker; orders a request's candidates."""

    def __init__(self, registry: WorkerRegistry, remembered: int = REMEMBERED_CONVERSATIONS):
        self._registry = registry
        self._last = BoundedMemo[bytes, WorkerId](remembered)

    def order(self, model: str, key: bytes, only: WorkerId | None) -> list[WorkerId]:
        """The ready workers serving ``model`` (``only``: that one or none), the
        conversation's last worker first, then by rendezvous weight of ``key``."""
        workers = [w.id for w in self._registry if model in w.models and w.ready_for(model)]
        if only is not None:
            return [only] if only in workers else []
        workers.sort(key=lambda worker: rendezvous_weight(key, worker), reverse=True)
        last = self._last.get(key)
        if last is not None and last in workers:
            workers.remove(last)
            workers.insert(0, last)
        return workers

    def sent(self, key: bytes, worker: WorkerId) -> None:
        """A request of conversation ``key``, tokenized by an engine, went to ``worker``."""
        self._last.put(key, worker)
