"""vLLM's Responses API: the request, the conversation it renders, the response object, its
stream events, and the replica's store of responses that ``previous_response_id`` continues.

The conversation is built as vLLM builds it (``construct_input_messages``): this request's
``instructions`` as a system message, then the stored conversation of the previous response
(its own messages, instructions included, then its output as an assistant message), then the
new ``input`` (a string is one user message). It is rendered by the same chat template as
``/v1/chat/completions``, so both APIs key the same prefix cache.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.backends.sim.protocol import ApiError, get_bool, get_int, get_str, json_encode

_NUMBER = (int, float)


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """What the simulator uses of a ``POST /v1/responses`` body."""

    model: str | None
    instructions: str | None
    input: str | list[dict[str, Any]]
    previous_response_id: str | None
    max_output_tokens: int | None
    stream: bool
    store: bool
    cache_salt: str | None
    tools: list[dict[str, Any]] | None
    temperature: float
    top_p: float
    metadata: dict[str, Any] | None
    request_id: str | None = None  # vLLM's extra field: becomes the response's id


def _float(data: Mapping[str, Any], name: str, default: float) -> float:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        raise ApiError(400, f"'{name}' must be a number", name)
    return float(value)


def parse_request(data: Mapping[str, Any]) -> ResponsesRequest:
    """The request, checked (400 naming the field); ``background`` is not served."""
    if get_bool(data, "background", False):
        raise ApiError(400, "background mode is not served by the simulator", "background")
    raw_input = data.get("input")
    if isinstance(raw_input, list):
        if not raw_input or not all(isinstance(item, dict) for item in raw_input):
            raise ApiError(400, "'input' must be a string or a non-empty array of items", "input")
    elif not isinstance(raw_input, str) or not raw_input:
        raise ApiError(400, "'input' must be a string or a non-empty array of items", "input")
    tools = data.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError(400, "'tools' must be an array of objects", "tools")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ApiError(400, "'metadata' must be an object", "metadata")
    return ResponsesRequest(
        model=get_str(data, "model"),
        instructions=get_str(data, "instructions") or None,
        input=raw_input,
        previous_response_id=get_str(data, "previous_response_id"),
        max_output_tokens=get_int(data, "max_output_tokens", None, 1),
        stream=get_bool(data, "stream", False),
        store=get_bool(data, "store", True),
        cache_salt=get_str(data, "cache_salt") or None,
        tools=tools or None,
        temperature=_float(data, "temperature", 1.0),
        top_p=_float(data, "top_p", 1.0),
        metadata=metadata,
        request_id=get_str(data, "request_id") or None,
    )


# --- the conversation ----------------------------------------------------------------------


def chat_tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses tools (flat) in the chat form the template renders, as vLLM converts them."""
    if request.tools is None:
        return None
    return [{"type": "function", "function": tool} for tool in request.tools]


def _part_text(part: Any) -> str:
    if isinstance(part, Mapping) and isinstance(part.get("text"), str):
        return str(part["text"])
    raise ApiError(400, "an assistant message's content parts need a 'text'", "input")


def _message(item: Mapping[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or not isinstance(content, str | list):
        raise ApiError(400, "a message item needs a 'role' and a 'content'", "input")
    if role == "assistant" and isinstance(content, list):
        if not content:
            raise ApiError(400, "an assistant message needs content", "input")
        content = _part_text(content[0])  # vLLM keeps the first part of an output message
    return {"role": role, "content": content}


def _item_message(item: Mapping[str, Any]) -> dict[str, Any]:
    """One input item as the chat message vLLM makes of it."""
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item)
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    raise ApiError(400, f"input items of type {kind!r} are not served by the simulator", "input")


def conversation(
    request: ResponsesRequest, history: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The chat messages the request's prompt is rendered from."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if history is not None:
        messages.extend(history)
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        messages.extend(_item_message(item) for item in request.input)
    return messages


# --- the store -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response: its object and the conversation a next turn continues."""

    body: dict[str, Any]
    history: list[dict[str, Any]]
    size: int


class ResponseStore:
    """The responses one replica produced (LRU, bounded by count and by conversation bytes)."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self._max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, body: dict[str, Any], history: list[dict[str, Any]]) -> None:
        size = len(json_encode(history))
        if not self.enabled or size > self._max_bytes:
            return
        old = self._items.pop(response_id, None)
        if old is not None:
            self._bytes -= old.size
        self._items[response_id] = StoredResponse(body, history, size)
        self._bytes += size
        while len(self._items) > self.capacity or self._bytes > self._max_bytes:
            _, evicted = self._items.popitem(last=False)
            self._bytes -= evicted.size

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for a response id it does not hold."""
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        "response_id",
        kind="invalid_request_error",
    )


# --- the response object and its stream events -----------------------------------------


def usage_body(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": max(cached_tokens, 0)},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponseObject:
    """Builds one response's object, output item and stream events (vLLM's simple path)."""

    def __init__(self, request: ResponsesRequest, model: str, max_output_tokens: int) -> None:
        self.request = request
        self.id = request.request_id or new_response_id()
        self.item_id = f"msg_{secrets.token_hex(16)}"
        self.model = model
        self.created_at = int(time.time())
        self.max_output_tokens = max_output_tokens
        self._seq = 0

    def message(self, text: str | None) -> dict[str, Any]:
        done = text is not None
        content: list[dict[str, Any]] = [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        ]
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": content if done else [],
        }

    def body(
        self, status: str, text: str | None = None, usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object; ``status`` ``incomplete`` = ended at ``max_output_tokens``."""
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [] if text is None else [self.message(text)],
            "usage": usage,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": r.instructions,
            "previous_response_id": r.previous_response_id,
            "max_output_tokens": self.max_output_tokens,
            "metadata": r.metadata,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": r.tools or [],
            "temperature": r.temperature,
            "top_p": r.top_p,
            "background": False,
            "service_tier": "auto",
            "truncation": "disabled",
            "text": {"format": {"type": "text"}},
            "reasoning": None,
            "user": None,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_encode(payload) + b"\n\n"

    def _at(self) -> dict[str, Any]:
        return {"output_index": 0, "item_id": self.item_id, "content_index": 0}

    def opening(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress`` (vLLM sends them at once)."""
        start = self.body("in_progress")
        return [
            self.event("response.created", response=start),
            self.event("response.in_progress", response=start),
        ]

    def first(self) -> list[bytes]:
        """The output message opens with the first token."""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=0, item=self.message(None)),
            self.event("response.content_part.added", **self._at(), part=part),
        ]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[])

    def closing(self, final: dict[str, Any]) -> list[bytes]:
        text = final["output"][0]["content"][0]["text"]
        part = {"type": "output_text", "text": text, "annotations": []}
        return [
            self.event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self.event("response.content_part.done", **self._at(), part=part),
            self.event("response.output_item.done", output_index=0, item=final["output"][0]),
            self.event("response.completed", response=final),
        ]

    def error(self, error: ApiError) -> bytes:
        """An error inside the stream (then it ends, without ``response.completed``)."""
        return self.event("error", code=error.kind, message=error.message, param=error.param)
