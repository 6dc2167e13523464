"""The engine's own tokenization (vLLM's and SGLang's ``POST /tokenize``, chat template
applied by the engine): the fallback for models whose tokenizer is not configured.

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
from collections.abc import Iterable
from typing import Annotated, Any

import httpx
import msgspec

from kvgate.index._http import call_engine
from kvgate.index.api import EngineWorker, PromptInput
from kvgate.index.errors import EngineCallError, JsonDecodeError
from kvgate.index.jsonsafe import decode_json_as

log = logging.getLogger(__name__)

_MAX_ANSWER_BYTES = 16 << 20  # 2M+ token ids as JSON: past any model's context
_TOKENIZING_ENGINES = frozenset({"vllm", "sglang"})  # /tokenize applies their chat template
MAX_ATTEMPTS = 2
"""Workers asked for one prompt: it is on the request path (each may cost its timeout)."""
_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class _Tokenized(msgspec.Struct):
    tokens: list[_TokenId]


def _tokenize_body(model: str, prompt: PromptInput) -> dict[str, Any]:
    """The ``/tokenize`` request of a prompt, as vLLM and SGLang take it."""
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
) -> list[int] | None:
    """The prompt's token ids from the first of ``workers`` (in their order) that can
    tokenize it, at most ``MAX_ATTEMPTS`` asked; None when none answered."""
    body = _tokenize_body(model, prompt)
    able = (worker for worker in workers if _can_tokenize(worker, model))
    for worker in itertools.islice(able, MAX_ATTEMPTS):
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
            continue
        if status != 200:
            continue
        try:
            return decode_json_as(answer, _Tokenized).tokens
        except JsonDecodeError as error:
            log.debug("%s: /tokenize answered %s", worker.id, error)
    return None
