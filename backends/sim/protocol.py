"""Parsing and shaping of the OpenAI / vLLM request and response bodies the replica serves."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

_json_decoder = msgspec.json.Decoder()
json_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        409: "ConflictError",
        413: "RequestTooLarge",
        429: "TooManyRequests",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        default = "ServerError" if status >= 500 else "ClientError"
        self.kind = kind or self.TYPES.get(status, default)

    def body(self) -> bytes:
        return json_encode(
            {"error": {"message": self.message, "type": self.kind, "param": self.param,
                       "code": self.status}}
        )  # fmt: skip


def parse_object(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body (400 otherwise)."""
    try:
        data = _json_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def get_bool(data: Mapping[str, Any], name: str, default: bool) -> bool:
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", name)
    return value


def get_int(data: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", name)
    if value < minimum:
        raise ApiError(400, f"'{name}' must be >= {minimum}", name)
    return value


def get_str(data: Mapping[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string", name)
    return value


def model_not_found(name: str) -> ApiError:
    """vLLM's answer for a ``model`` that is neither the served model nor a loaded adapter."""
    return ApiError(404, f"The model `{name}` does not exist.", "model")


def parse_messages(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(400, f"messages[{i}].content must be a string or an array", "messages")
    return messages


def parse_tools(data: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = data.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError(400, "'tools' must be an array of objects", "tools")
    return tools


def parse_prompt(data: Mapping[str, Any], vocab_size: int) -> str | list[int]:
    """A completion prompt: text or token ids (one prompt; batches are not simulated)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"token ids must be within 0..{vocab_size - 1}", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not supported by the simulator", "prompt")
    raise ApiError(400, "'prompt' must be a string or an array of token ids", "prompt")


@dataclass(frozen=True, slots=True)
class Sampling:
    """What the simulator uses of a request's sampling options."""

    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None


def parse_sampling(data: Mapping[str, Any], default_max_tokens: int, chat: bool) -> Sampling:
    n = get_int(data, "n", 1, 1)
    if n != 1:
        raise ApiError(400, "the simulator serves n=1 only", "n")
    max_tokens = get_int(data, "max_tokens", None, 1)
    if chat:
        max_tokens = get_int(data, "max_completion_tokens", max_tokens, 1)
    stream = get_bool(data, "stream", False)
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    options = options or {}
    return Sampling(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        stream=stream,
        include_usage=get_bool(options, "include_usage", False),
        continuous_usage=get_bool(options, "continuous_usage_stats", False),
        cache_salt=get_str(data, "cache_salt") or None,
    )


def check_length(
    prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "max_tokens"
) -> None:
    if prompt_tokens == 0:
        raise ApiError(400, "The prompt cannot be empty.", "prompt")
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "the completion.",
            param,
        )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": max(cached_tokens, 0)},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


@dataclass(slots=True)
class ResponseShape:
    """Builds the bodies and stream chunks of one chat or completion response."""

    chat: bool
    model: str
    request_id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> ResponseShape:
        return cls(chat, model, new_id("chatcmpl" if chat else "cmpl"), int(time.time()))

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage_body: dict[str, Any]) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            head = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            head = self._head("text_completion")
        return json_encode({**head, "choices": [choice], "usage": usage_body})

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        usage_body: dict[str, Any] | None = None,
    ) -> bytes:
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if first else {"content": text}
            )
            choice: dict[str, Any] = {
                "index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
            }  # fmt: skip
            head = self._head("chat.completion.chunk")
        else:
            choice = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": None,
            }  # fmt: skip
            head = self._head("text_completion")
        body: dict[str, Any] = {**head, "choices": [choice]}
        if usage_body is not None:
            body["usage"] = usage_body
        return b"data: " + json_encode(body) + b"\n\n"

    def usage_chunk(self, usage_body: dict[str, Any]) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._head(kind), "choices": [], "usage": usage_body}
        return b"data: " + json_encode(body) + b"\n\n"


def sse_error(error: ApiError) -> bytes:
    return b"data: " + error.body() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def render_request(
    token_ids: Sequence[int], model: str, max_tokens: int, stream: bool
) -> dict[str, Any]:
    """The ``GenerateRequest`` that vLLM's ``/render`` endpoints return."""
    return {
        "request_id": new_id("render"),
        "model": model,
        "token_ids": list(token_ids),
        "sampling_params": {"max_tokens": max_tokens},
        "stream": stream,
    }
