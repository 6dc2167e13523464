"""Which engine paths kvgate passes through (``Gateway.pass_through``): an allowlist.

By default, the work a client asks of a model that has no prompt prefix to reuse
(embeddings, vLLM's rerank and score) and the Responses API's stored responses by id (read,
delete, cancel). Everything else an engine serves under ``/v1`` (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, ...) is the engine's
administration, not a client's: refused with a 404 unless the operator names the path
(``--pass-through-path``). ``/v1/models`` is kvgate's own (the fleet's models).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvgate.router.errors import InvalidRequest
from kvgate.router.requests import normalised_path

_DEFAULT = frozenset(
    ("POST", path) for path in ("/v1/embeddings", "/v1/rerank", "/v1/score", "/rerank", "/score")
)
ROOT_PATHS = ("/rerank", "/score")
"""vLLM's paths outside ``/v1`` that kvgate routes (the rest of its routes are ``/v1/*``)."""
_STORED = re.compile(r"/v1/responses/[^/]+")
_CANCEL = re.compile(r"/v1/responses/[^/]+/cancel")
STORED_METHODS = ("GET", "DELETE")


def check_extra_path(path: str) -> str:
    """An operator's extra path: a normalised ``/v1/...`` path (ValueError naming why)."""
    if not path.startswith("/v1/") or len(path) == len("/v1/"):
        raise ValueError(f"{path!r}: pass-through paths are /v1/... paths")
    try:
        normal = normalised_path(path)
    except InvalidRequest as exc:
        raise ValueError(f"{path!r}: {exc.message}") from exc
    if normal != path:
        raise ValueError(f"{path!r}: give the path without repeated slashes")
    return path


class PassThroughPaths:
    """The default paths and the operator's ``extra`` ones (any method, exact paths)."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self._extra = frozenset(extra)

    def permits(self, method: str, path: str) -> bool:
        """Is ``method path`` (a ``normalised_path``) passed to engines?"""
        if (method, path) in _DEFAULT or path in self._extra:
            return True
        if _STORED.fullmatch(path) is not None:
            return method in STORED_METHODS
        return method == "POST" and _CANCEL.fullmatch(path) is not None
