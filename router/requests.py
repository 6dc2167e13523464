"""Request bodies: parsed once (pydantic-core's JSON parser), validated only where routing needs it.

The pydantic models below declare the handful of fields kvgate reads and keep every other
field (``extra="allow"``); the gateway forwards the client's original bytes unless it had
to change something (the streamed usage request).

Whatever a client sends, parsing ends in a body or in an ``InvalidRequest`` (400): JSON
nested deeper than ``MAX_JSON_DEPTH`` is refused by the parser (so nothing later walks a
crafted depth recursively), and completion token ids must fit an engine's uint32.
"""

from __future__ import annotations

import asyncio
import math
import re
from array import array
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast
from urllib.parse import quote

import msgspec
import pydantic
from pydantic import BaseModel, ConfigDict, StrictBool, field_validator

from kvgate.index import jsonsafe
from kvgate.index.api import PromptInput
from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import MAX_JSON_DEPTH
from kvgate.router.errors import InvalidJSON, InvalidRequest

B = TypeVar("B", bound=BaseModel)

_encode = msgspec.json.Encoder().encode

MAX_TOKEN_ID = 2**32 - 1
_UINT32 = "I" if array("I").itemsize == 4 else "L"  # an array type code of 32-bit items
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SLASHES = re.compile(r"/{2,}")
_PATH_SAFE = "/:@!$&'()*+,;=-._~"  # RFC 3986 path characters kept as they are
_QUERY = re.compile(rb"[!-~]*")  # printable ASCII, no space


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class _Routable(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    max_tokens: int | None = None
    cache_salt: str | None = None


class ChatBody(_Routable):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def prompt_input(self) -> PromptInput:
        return PromptInput(
            kind="chat",
            messages=self.messages,
            tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
            cache_salt=self.cache_salt,
        )

    @property
    def output_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionBody(_Routable):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _token_ids_fit_uint32(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            for ids in [prompt] if isinstance(prompt[0], int) else prompt:
                if not _fits_uint32(ids):
                    raise ValueError(f"token ids must be within 0..{MAX_TOKEN_ID}")
        return prompt

    def prompt_input(self) -> PromptInput:
        """The prompt that decides routing: the first one of a batch."""
        prompt = self.prompt
        first: str | list[int]
        if isinstance(prompt, str):
            first = prompt
        elif not prompt or isinstance(prompt[0], int):
            first = cast(list[int], prompt)  # validated: one int means all are ints
        else:
            head = prompt[0]
            first = head if isinstance(head, str) else list(head)
        return PromptInput(kind="completion", prompt=first, cache_salt=self.cache_salt)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


class ResponsesBody(_Routable):
    """``POST /v1/responses``: what routing reads of it (every other field is forwarded)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: StrictBool | None = None  # false: the engine keeps nothing to continue
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = None

    def prompt_input(self) -> tuple[PromptInput | None, str]:
        """The prompt the engine renders (vLLM: ``instructions`` as a system message, a
        string ``input`` as one user message, message items as chat messages, through the
        chat template of ``/v1/chat/completions``), or None and why it cannot be known."""
        if self.previous_response_id is not None:
            return None, "continues a stored response: its conversation is on the engine"
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                message = _item_message(item)
                if message is None:
                    return None, f"an input item of type {item.get('type')!r} is not rendered"
                messages.append(message)
        tools = [{"type": "function", "function": t} for t in self.tools] if self.tools else None
        prompt = PromptInput(
            kind="chat",
            messages=messages,
            tools=tools,
            cache_salt=self.cache_salt,
            add_special_tokens=True,  # vLLM tokenizes Responses prompts with them, unlike chats
        )
        return prompt, "rendered"

    @property
    def output_limit(self) -> int | None:
        return self.max_output_tokens


def _item_message(item: dict[str, Any]) -> dict[str, Any] | None:
    """One Responses input item as the chat message vLLM makes of it (None: a shape whose
    rendering kvgate does not reproduce: content parts, reasoning, images, ...)."""
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if role == "assistant" and isinstance(content, list) and content:
            first = content[0]  # vLLM keeps the first part of an output message
            content = first.get("text") if isinstance(first, dict) else None
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        return {"role": role, "content": content}
    if kind == "function_call":
        function = {"name": item.get("name"), "arguments": item.get("arguments")}
        call = {"id": item.get("call_id"), "type": "function", "function": function}
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    return None


class AnyModelBody(BaseModel):
    """Any other /v1/* body: only ``model`` matters (to pick a worker serving it)."""

    model_config = ConfigDict(extra="allow")

    model: str


def _fits_uint32(ids: list[int]) -> bool:
    try:
        array(_UINT32, ids)  # C speed: about 5 ns an id
    except OverflowError:
        return False
    return True


def decode_json(body: bytes) -> Any:
    """The body as JSON (nested at most ``MAX_JSON_DEPTH`` levels), or ``InvalidJSON``.

    ``index.jsonsafe``'s parser (every layer's): as fast as msgspec's on request bodies, it
    refuses deep nesting itself without recursing (no ``RecursionError`` whatever the
    input), and strict JSON (no ``NaN``)."""
    try:
        return jsonsafe.decode_json(body)
    except JsonDecodeError as exc:
        if exc.too_deep:
            message = f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
            raise InvalidJSON(message) from exc
        raise InvalidJSON(f"request body is not valid JSON: {exc.__cause__}") from exc


def decode_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``InvalidJSON`` / ``InvalidRequest``."""
    data = decode_json(body)
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def validate(model: type[B], data: dict[str, Any]) -> B:
    """Validate ``data``; the most specific problem becomes a 400 naming the field.

    Of a union's failures the deepest is the one meant (``prompt.1`` out of range, rather
    than "prompt is not a string")."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = max(errors, key=lambda e: len(e["loc"]))
        path = _data_path(data, err["loc"], missing=err["type"] == "missing")
        param = ".".join(str(part) for part in path) or None
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidRequest(f"{param}: {err['msg']}{more}", param=param) from exc


def _data_path(data: Any, loc: tuple[int | str, ...], *, missing: bool) -> list[int | str]:
    """The part of a pydantic error location present in the data (drops union tags such
    as ``str`` or ``list[int]``); a missing field is named as the last element."""
    path: list[int | str] = []
    for part in loc:
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and part < len(data)
        if in_dict or in_list:
            data = data[part]
        else:
            if missing and isinstance(data, dict):
                path.append(part)
            break
        path.append(part)
    return path


def with_usage_requested(data: dict[str, Any]) -> bytes:
    """The body re-encoded with ``stream_options.include_usage = true``."""
    options = data.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return _encode({**data, "stream_options": options})


_USAGE_OPTION = b'"stream_options":{"include_usage":true},'


def raw_with_usage_requested(raw: bytes, data: dict[str, Any]) -> bytes:
    """``raw`` (which decodes to ``data``) with ``stream_options.include_usage = true``: the
    member is put in front of the client's own bytes when the body has no ``stream_options``
    (the same JSON object, without re-encoding a long prompt), else re-encoded."""
    if not data or "stream_options" in data:
        return with_usage_requested(data)
    start = raw.index(b"{") + 1  # ``data`` is an object: its first byte past whitespace
    return raw[:start] + _USAGE_OPTION + raw[start:]


def check_path(path: str) -> None:
    """A decoded request path with control characters (NUL, CR, LF, ...) is a 400."""
    if _CONTROL.search(path):
        raise InvalidRequest("the request path holds control characters")


def normalised_path(path: str) -> str:
    """A pass-through's decoded ``path``: without control characters or dot segments (else
    a 400), slashes collapsed (``router.passthrough`` decides whether it is passed on)."""
    check_path(path)
    path = _SLASHES.sub("/", path)
    segments = path.split("/")
    if "." in segments or ".." in segments:
        raise InvalidRequest("the request path holds '.' or '..' segments")
    return path


def upstream_target(path: str, query: bytes) -> str:
    """The request target a pass-through sends upstream, from its ``normalised_path`` and
    the raw ``query``: the path re-encoded; the query as sent, printable ASCII only (else
    a 400)."""
    if not _QUERY.fullmatch(query):
        raise InvalidRequest("the query string holds spaces, control or non-ASCII bytes")
    target = quote(path, safe=_PATH_SAFE)
    return f"{target}?{query.decode('ascii')}" if query else target


# -- request headers and the connection --------------------------------------------------

TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")
"""Headers in which a client states its own timeout, in seconds (the OpenAI SDKs send the
second): a queued request waits no longer than that."""
_MAX_HEADER_CHARS = 32


def client_timeout_s(headers: Mapping[str, str]) -> float | None:
    """The client's own timeout from ``TIMEOUT_HEADERS`` (first found), or None; a value
    that is not a positive finite number of seconds is a 400 naming the header."""
    for name in TIMEOUT_HEADERS:
        text = headers.get(name)
        if text is None:
            continue
        try:
            value = float(text) if len(text) <= _MAX_HEADER_CHARS else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise InvalidRequest(f"{name}: expected a positive number of seconds", param=name)
        return value
    return None


Receive = Callable[[], Awaitable[Mapping[str, Any]]]


def disconnect_of(receive: Receive) -> Callable[[], Awaitable[None]]:
    """An awaitable factory that returns when the ASGI client disconnects (the request
    body already read: the next message is the disconnect)."""

    async def disconnected() -> None:
        for _ in range(1_000_000):  # bounded; a body-less message may come before
            if (await receive())["type"] == "http.disconnect":
                return
        await asyncio.Event().wait()  # never: a client flooding empty messages waits out

    return disconnected
