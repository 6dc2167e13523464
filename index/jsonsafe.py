"""JSON from outside kvgate (clients' bodies, engines' answers), decoded depth-safe.

Every layer decodes untrusted JSON here, through one parser: pydantic-core's, which refuses
nesting deeper than ``MAX_JSON_DEPTH`` itself, without recursing (no ``RecursionError``
whatever the input and however deep the caller's stack), and reads strict JSON (no ``NaN`` or
``Infinity``). What it returns is at most that deep, so nothing that walks it later (a
re-encoding, a log line, a validation) recurses on a crafted depth either. A typed decode
(``decode_json_as``) converts that result with msgspec. Both raise ``JsonDecodeError`` (a
``ValueError``), never anything else, on any input.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from pydantic_core import from_json

from kvgate.index.errors import JsonDecodeError

T = TypeVar("T")

MAX_JSON_DEPTH = 200
"""Deepest nesting of arrays and objects accepted: pydantic-core's parser's fixed limit
(tool schemas need a few dozen levels; Python code walking a body recursively is safe)."""
_TOO_DEEP = "recursion limit exceeded"


def decode_json(data: bytes | bytearray | str) -> Any:
    """``data`` as JSON, nested at most ``MAX_JSON_DEPTH`` levels, or ``JsonDecodeError``
    (``too_deep`` when the nesting was the problem)."""
    try:
        return from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        if str(exc).startswith(_TOO_DEEP):
            raise JsonDecodeError(
                f"JSON nested deeper than {MAX_JSON_DEPTH} levels", too_deep=True
            ) from exc
        raise JsonDecodeError(f"not valid JSON: {exc}") from exc


def decode_json_as(data: bytes | bytearray | str, kind: type[T]) -> T:
    """``data`` as JSON (``decode_json``) converted to ``kind`` (a msgspec-convertible type:
    a ``msgspec.Struct`` ignores the fields it does not declare), or ``JsonDecodeError``."""
    decoded = decode_json(data)
    try:
        return msgspec.convert(decoded, kind)
    except msgspec.ValidationError as exc:
        raise JsonDecodeError(f"unexpected JSON: {exc}") from exc
