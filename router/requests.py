"""Request bodies: parsed once with msgspec, validated only where routing needs it.

The pydantic models below declare the handful of fields kvgate reads and keep every other
field (``extra="allow"``); the gateway forwards the client's original bytes unless it had
to change something (the streamed usage request).
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import msgspec
import pydantic
from pydantic import BaseModel, ConfigDict, StrictBool

from index.api import PromptInput
from router.errors import InvalidJSON, InvalidRequest

B = TypeVar("B", bound=BaseModel)

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


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


class AnyModelBody(BaseModel):
    """Any other /v1/* body: only ``model`` matters (to pick a worker serving it)."""

    model_config = ConfigDict(extra="allow")

    model: str


def decode_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``InvalidJSON`` / ``InvalidRequest``."""
    try:
        data = _decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def validate(model: type[B], data: dict[str, Any]) -> B:
    """Validate ``data``; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        path = _data_path(data, err["loc"], missing=err["type"] == "missing")
        param = ".".join(str(part) for part in path) or None
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
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
