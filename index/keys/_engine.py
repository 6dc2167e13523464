"""The engine's own tokenization: the fallback for models whose tokenizer is not configured
(or whose local template disagrees with the engine's, ``_render.py``'s self-check).

vLLM's renderer (``POST /v1/chat/completions/render``, ``/v1/completions/render``: the token
ids it would prefill for that very request, tools, reasoning and template included) is asked
first; where it is off (vLLM answers 403 without ``--enable-scale-out``, 404 before it) the
worker is not asked again for ``RENDER_RETRY_S``, and ``POST /tokenize`` (vLLM, SGLang:
chat template applied by the engine) answers instead.

A prompt goes only to workers it may be routed to, the likeliest destination first (the
caller's order, ``index.api.TokenizeOn``): a worker that will not serve a prompt never reads
it, and its tokens never key prompts for the others. Asked of healthy vLLM or SGLang workers
serving the model, one after another until one answers, at most ``MAX_ATTEMPTS`` of them,
each call bounded (index/_http.py) and its answer checked: token ids in 0..2**32-1, or it is
not used.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import httpx
import msgspec

from kvgate.index._http import call_engine
from kvgate.index.api import EngineWorker, PromptInput
from kvgate.index.errors import EngineCallError, JsonDecodeError
from kvgate.index.jsonsafe import decode_json_as
from kvgate.index.memo import BoundedMemo

log = logging.getLogger(__name__)

_MAX_ANSWER_BYTES = 16 << 20  # 2M+ token ids as JSON: past any model's context
_TOKENIZING_ENGINES = frozenset({"vllm", "sglang"})  # /tokenize applies their chat template
_RENDERING_ENGINES = frozenset({"vllm"})  # /v1/chat/completions/render, /v1/completions/render
_RENDER_OFF = frozenset({403, 404, 405, 501})  # the renderer is not served there
RENDER_RETRY_S = 60.0
"""How long a worker whose renderer was off is asked ``/tokenize`` instead."""
_MAX_REMEMBERED_WORKERS = 4096
MAX_ATTEMPTS = 2
"""Workers asked for one prompt: it is on the request path (each may cost its timeout)."""
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class _Tokenized(msgspec.Struct):
    tokens: list[_TokenId]


class _Rendered(msgspec.Struct):
    token_ids: list[_TokenId]


class RenderState:
    """Which workers served no renderer lately (asked ``/tokenize`` instead until then)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._off_until = BoundedMemo[str, float](_MAX_REMEMBERED_WORKERS)

    def usable(self, worker: EngineWorker) -> bool:
        if worker.engine not in _RENDERING_ENGINES:
            return False
        until = self._off_until.get(worker.id)
        return until is None or self._clock() >= until

    def refused(self, worker: EngineWorker) -> None:
        self._off_until.put(worker.id, self._clock() + RENDER_RETRY_S)


def render_body(model: str, prompt: PromptInput) -> dict[str, Any]:
    """The ``/tokenize`` (and renderer) request of a prompt, as vLLM and SGLang take it."""
    body: dict[str, Any] = {"model": model}
    if prompt.kind == "completion":
        body["prompt"] = prompt.prompt or ""
        return body
    body["messages"] = list(prompt.messages or [])
    body["add_generation_prompt"] = prompt.add_generation_prompt
    if prompt.add_special_tokens is not None:
        body["add_special_tokens"] = prompt.add_special_tokens
    if prompt.tools:
        body["tools"] = list(prompt.tools)
    if prompt.chat_template_kwargs:
        body["chat_template_kwargs"] = dict(prompt.chat_template_kwargs)
    return body


def _can_tokenize(worker: EngineWorker, model: str) -> bool:
    """A healthy vLLM or SGLang worker that serves ``model`` (or whose model is not known)."""
    return (
        worker.healthy
        and worker.engine in _TOKENIZING_ENGINES
        and (worker.model is None or worker.model == model)
    )


def tokenizing_engines(workers: Iterable[EngineWorker], model: str) -> list[str]:
    """The engine kinds of ``workers`` that can tokenize ``model``'s prompts, in the order of
    their first such worker."""
    kinds: dict[str, None] = {}
    for worker in workers:
        if _can_tokenize(worker, model):
            kinds.setdefault(worker.engine)
    return list(kinds)


async def engine_tokens(
    http: httpx.AsyncClient,
    workers: Iterable[EngineWorker],
    model: str,
    prompt: PromptInput,
    *,
    timeout_s: float,
    render: RenderState | None = None,
) -> list[int] | None:
    """The prompt's token ids from the first of ``workers`` (in their order) that can
    tokenize it, at most ``MAX_ATTEMPTS`` asked, by its renderer when ``render`` says it has
    one, else its ``/tokenize``; None when none answered."""
    body = render_body(model, prompt)
    able = (worker for worker in workers if _can_tokenize(worker, model))
    for worker in itertools.islice(able, MAX_ATTEMPTS):
        if render is not None and render.usable(worker):
            chat = prompt.kind == "chat"
            ids = await _rendered(http, worker, body, chat=chat, timeout_s=timeout_s, render=render)
            if ids is not None:
                return ids
        ids = await _tokenized(http, worker, body, timeout_s)
        if ids is not None:
            return ids
    return None


async def _rendered(
    http: httpx.AsyncClient,
    worker: EngineWorker,
    body: dict[str, Any],
    *,
    chat: bool,
    timeout_s: float,
    render: RenderState,
) -> list[int] | None:
    """The worker renderer's token ids for ``body`` (None: no usable answer)."""
    path = "/v1/chat/completions/render" if chat else "/v1/completions/render"
    try:
        status, answer = await call_engine(
            http, worker, "POST", path, timeout_s=timeout_s, max_bytes=_MAX_ANSWER_BYTES, json=body
        )
    except EngineCallError as error:
        log.debug("%s: %s failed: %s", worker.id, path, error)
        return None
    if status in _RENDER_OFF:
        log.info("%s: no renderer (%s answered %d): /tokenize instead", worker.id, path, status)
        render.refused(worker)
        return None
    if status != 200:
        return None
    try:
        if chat:
            return decode_json_as(answer, _Rendered).token_ids
        rendered = decode_json_as(answer, list[_Rendered])
    except JsonDecodeError as error:
        log.debug("%s: %s answered %s", worker.id, path, error)
        return None
    return rendered[0].token_ids if len(rendered) == 1 else None


async def _tokenized(
    http: httpx.AsyncClient, worker: EngineWorker, body: dict[str, Any], timeout_s: float
) -> list[int] | None:
    """The worker's ``/tokenize`` token ids for ``body`` (None: no usable answer)."""
    try:
        status, answer = await call_engine(
            http,
            worker,
            "POST",
            "/tokenize",
            timeout_s=timeout_s,
            max_bytes=_MAX_ANSWER_BYTES,
            json=body,
        )
    except EngineCallError as error:
        log.debug("%s: /tokenize failed: %s", worker.id, error)
        return None
    if status != 200:
        return None
    try:
        return decode_json_as(answer, _Tokenized).tokens
    except JsonDecodeError as error:
        log.debug("%s: /tokenize answered %s", worker.id, error)
        return None
