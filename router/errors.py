"""kvgate's one error hierarchy and its OpenAI-style wire form.

Every failure the gateway reports to a client is a ``KvgateError``: it knows its HTTP status,
the OpenAI error ``type``, a machine ``code`` and the offending ``param``::

    KvgateError                      500 server_error
    ├── InvalidRequest               400 invalid_request_error
    │   └── InvalidJSON              400
    ├── Unauthorized                 401 authentication_error (WWW-Authenticate: Bearer)
    ├── Forbidden                    403 permission_error
    │   ├── AdminDisabled            403 (no admin token, kvgate listens beyond loopback)
    │   ├── AdminRefused             403 (an admin call with an Origin or a foreign Host)
    │   └── WorkerNotAllowed         403 (a run-time worker outside --worker-allow)
    ├── RequestTimeout               408 (head or body too slow; connection closed)
    ├── RequestHeadTooLarge          431 (head bytes or lines), 414 (target); closed
    ├── NotFound                     404 (and 405 for a known path, another method)
    │   ├── ModelNotFound            404
    │   ├── PreviousResponseGone     404 (the worker holding a previous_response_id left)
    │   ├── ResponseNotFound         404 (a response id not this client key's)
    │   ├── PathNotPassedThrough     404 (a /v1 path outside the pass-through allowlist)
    │   └── WorkerNotFound           404 <- backends.errors.WorkerNotFound
    ├── WorkerExists                 409 <- backends.errors.WorkerExists
    ├── PayloadTooLarge              413
    ├── UnsupportedMediaType         415 (an admin body that is not application/json)
    ├── ClientClosed                 499 (nobody reads it: the client is gone)
    ├── QueueFull                    429 + Retry-After (the queue, or a key's or model's share)
    ├── QueueTimeout                 503 + Retry-After (waited queued past the deadline)
    ├── TooManyConnections           503 + Retry-After (connection closed)
    ├── NoHealthyWorker              503 + Retry-After
    ├── PreviousResponseUnavailable  503 + Retry-After (its worker is down or not ready)
    ├── UpstreamError                502 upstream_error <- httpx.HTTPError
    │   ├── UpstreamConnectError     502 (retryable: nothing reached the engine)
    │   ├── UpstreamProtocolError    502 (retryable before the first token; also a
    │   │                                response head past its bounds)
    │   ├── UpstreamStreamError      502 (an error event before the first token, retryable)
    │   ├── UpstreamTimeout          504 (retryable before the first token)
    │   └── UpstreamResponseTooLarge 502
    └── UpstreamHTTPError            the engine's own 4xx/5xx, status and body passed through
                                     (a 5xx is retried on another worker first)

Errors of the layers below are mapped here, where HTTP is known, with ``raise ... from exc``:
``from_httpx`` for engine failures, ``from_backend`` (and the ``backend_errors`` block) for
the worker registry's refusals, ``from_scheduling`` (and ``scheduling_errors``) for the
scheduler's (no worker, the queue full or timed out, a stored response's worker gone).
Before a response has started the error becomes a JSON response; once a stream has started
(at its first token, ``router.commit``) it goes inside the stream as an SSE
``data: {"error": ...}`` event (``sse_bytes``).

Not client errors, and so outside the tree: ``router.config.ConfigError`` (invalid settings
at start-up), ``router.simfleet.SimFleetError`` (``--sim`` replicas did not come up) and
``router.upstream.BodyTooLarge`` (internal, becomes ``UpstreamResponseTooLarge``).

What a client reads of an upstream failure is its kind (cannot connect, timed out, broke
the connection) and the worker, never the network detail (errno text, addresses, status of
a probe): that stays in ``UpstreamError.detail`` for logs and the admin view.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import httpx
import msgspec

from kvgate.backends import errors as backend
from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json
from kvgate.router.upstream import ResponseHeadTooLarge
from kvgate.scheduling import errors as scheduling

_json_encode = msgspec.json.Encoder().encode
_NOT_JSON = object()


class KvgateError(Exception):
    """Base of every error kvgate reports to a client."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    retryable: bool = False  # may the gateway try another worker (before the first token)?

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def payload(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return _json_encode(self.payload())

    def sse_bytes(self) -> bytes:
        """The error as in-stream SSE events: the error event, then ``[DONE]``."""
        return b"data: " + self.body_bytes() + b"\n\ndata: [DONE]\n\n"


class InvalidRequest(KvgateError):
    """Malformed or invalid request (400); ``param`` names the field."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(InvalidRequest):
    code = "invalid_json"


class Unauthorized(KvgateError):
    """Missing or wrong client API key or admin token (401)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"www-authenticate": "Bearer"})


class Forbidden(KvgateError):
    """Authenticated or not, this caller may not do this (403)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class AdminDisabled(Forbidden):
    """No admin token is set and kvgate listens beyond loopback: admin and debug are off."""

    code = "admin_disabled"

    def __init__(self) -> None:
        super().__init__(
            "the admin API is disabled: kvgate listens beyond loopback and no admin token is "
            "set (--admin-token or KVGATE_ADMIN_TOKEN)"
        )


class AdminRefused(Forbidden):
    """An admin or debug call a browser may have sent (an ``Origin`` header), or one naming
    a foreign ``Host`` while the admin API is open on loopback (DNS rebinding)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message, code=code)


class WorkerNotAllowed(Forbidden):
    """A worker added at run time is on a host outside ``--worker-allow``."""

    code = "worker_not_allowed"

    def __init__(self, host: str, *, param: str, rules: str) -> None:
        super().__init__(
            f"host {host!r} is not allowed for workers added at run time (allowed: {rules}; "
            "see --worker-allow)",
            param=param,
        )


class RequestTimeout(KvgateError):
    """The client did not send its request (head or body) in time (408; connection closed)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"connection": "close"})


class RequestHeadTooLarge(KvgateError):
    """A request head past the listener's bounds: too many bytes or header lines (431), or
    a request target too long (414). The connection is closed."""

    type = "invalid_request_error"

    def __init__(self, message: str, *, status: int, code: str) -> None:
        super().__init__(message, code=code, headers={"connection": "close"})
        self.status = status


class TooManyConnections(KvgateError):
    """Every client connection slot is taken (503 + Retry-After; connection closed)."""

    status = 503
    type = "service_unavailable_error"
    code = "too_many_connections"

    def __init__(self, limit: int, *, retry_after_s: int = 1) -> None:
        super().__init__(
            f"kvgate serves at most {limit} client connections at once; retry later",
            headers={"retry-after": str(retry_after_s), "connection": "close"},
        )


class ClientClosed(KvgateError):
    """The client went away before its request was read (nginx's 499; nobody sees it)."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("the client closed the connection before sending its whole request")


class NotFound(KvgateError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    """No configured worker serves the requested model (404)."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")


class PreviousResponseGone(NotFound):
    """The worker that produced a ``previous_response_id`` has left: its store went with it."""

    code = "previous_response_not_found"

    def __init__(self, response_id: str, worker: str) -> None:
        super().__init__(
            f"previous_response_id '{response_id}' was produced by worker {worker}, which has "
            "left the fleet: the stored conversation is gone. Send the conversation again "
            "without previous_response_id",
            param="previous_response_id",
        )


class ResponseNotFound(NotFound):
    """A stored response this client key did not create through kvgate, or one kvgate no
    longer remembers (``param``: ``response_id`` or ``previous_response_id``)."""

    def __init__(self, response_id: str, *, param: str) -> None:
        code = "previous_response_not_found" if param == "previous_response_id" else None
        super().__init__(
            f"Response with id '{response_id}' not found.",
            param=param,
            code=code or "response_not_found",
        )


class PathNotPassedThrough(NotFound):
    """A ``/v1`` path kvgate does not pass to engines (``--pass-through-path`` opts one in)."""

    code = "not_found"

    def __init__(self, method: str, path: str) -> None:
        super().__init__(
            f"{method} {path} is not served by kvgate (engine paths other than embeddings, "
            "rerank, score and responses by id are passed through only when the operator "
            "allows them: --pass-through-path)"
        )


class WorkerNotFound(NotFound):
    code = "worker_not_found"

    def __init__(self, worker: str) -> None:
        super().__init__(f"no worker {worker!r} is registered", param="id")


class WorkerExists(KvgateError):
    status = 409
    type = "invalid_request_error"
    code = "worker_exists"

    def __init__(self, worker: str) -> None:
        super().__init__(f"worker {worker!r} is already registered", param="url")


class PayloadTooLarge(KvgateError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes")


class UnsupportedMediaType(KvgateError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"

    def __init__(self, expected: str) -> None:
        super().__init__(f"the request body must be sent as Content-Type: {expected}")


class NoHealthyWorker(KvgateError):
    """Workers serve the model but none is healthy right now (503 + Retry-After)."""

    status = 503
    type = "service_unavailable_error"
    code = "no_healthy_worker"

    def __init__(self, model: str, *, retry_after_s: int = 1) -> None:
        super().__init__(
            f"no healthy worker serves model '{model}'",
            param="model",
            headers={"retry-after": str(retry_after_s)},
        )


class PreviousResponseUnavailable(KvgateError):
    """The worker holding a ``previous_response_id`` cannot take it now (503 + Retry-After)."""

    status = 503
    type = "service_unavailable_error"
    code = "previous_response_worker_unavailable"

    def __init__(self, response_id: str, worker: str, why: str, *, retry_after_s: int = 1) -> None:
        super().__init__(
            f"previous_response_id '{response_id}' is held by worker {worker}, which is {why}: "
            "only that worker can continue it; retry later",
            param="previous_response_id",
            headers={"retry-after": str(retry_after_s)},
        )


class QueueFull(KvgateError):
    """The router-side queue, or the share of it one API key or model may hold, is full
    (429 + Retry-After); ``code`` names which."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, *, code: str, retry_after_s: int = 1) -> None:
        super().__init__(message, code=code, headers={"retry-after": str(retry_after_s)})


class QueueTimeout(KvgateError):
    """A request waited queued until its deadline without a worker freeing up (503)."""

    status = 503
    type = "service_unavailable_error"
    code = "queue_timeout"

    def __init__(self, waited_s: float, *, retry_after_s: int = 1) -> None:
        self.waited_s = waited_s
        super().__init__(
            f"every worker stayed busy for the {waited_s:.3g} s this request could wait; "
            "retry later",
            headers={"retry-after": str(retry_after_s)},
        )


class UpstreamError(KvgateError):
    """The chosen engine failed; ``worker`` is its URL, ``detail`` what exactly happened
    (for logs and the admin view; the client reads ``message``)."""

    status = 502
    type = "upstream_error"
    code = "upstream_error"

    def __init__(self, message: str, *, worker: str, detail: str | None = None) -> None:
        super().__init__(f"{message} (worker {worker})")
        self.worker = worker
        self.detail = f"{message}: {detail}" if detail else message


class UpstreamConnectError(UpstreamError):
    """Connection refused, reset or not established in time: nothing reached the engine."""

    code = "upstream_connect_error"
    retryable = True


class UpstreamProtocolError(UpstreamError):
    """The engine closed the connection or broke HTTP (before or during the response)."""

    code = "upstream_protocol_error"
    retryable = True  # only ever retried before the first token


class UpstreamStreamError(UpstreamError):
    """The engine's stream carried an error event before any token (``detail``: its message);
    retried on another worker, a 502 once none is left."""

    code = "upstream_stream_error"
    retryable = True


class UpstreamTimeout(UpstreamError):
    """The engine did not answer (or send the next chunk, or finish) in time (504)."""

    status = 504
    code = "upstream_timeout"
    retryable = True  # only ever retried before the first token


class UpstreamResponseTooLarge(UpstreamError):
    """A non-streamed answer larger than ``upstream.max_response_bytes`` (502)."""

    code = "upstream_response_too_large"

    def __init__(self, limit: int, *, worker: str) -> None:
        super().__init__(f"the engine's answer exceeds the limit of {limit} bytes", worker=worker)


class UpstreamHTTPError(KvgateError):
    """An engine 4xx/5xx, passed through to the client unchanged (status and body), unless
    the body is JSON nested deeper than ``MAX_JSON_DEPTH``: then kvgate's own error body
    says so (a client's parser is not handed what kvgate refuses itself)."""

    def __init__(self, status: int, body: bytes, content_type: str | None, *, worker: str) -> None:
        super().__init__(f"upstream answered {status} (worker {worker})")
        self.status = status
        self.type = "upstream_error"
        self.code = f"upstream_http_{status}"
        self.retryable = status >= 500  # a server error: another worker may do better
        self.body = body
        self.content_type = content_type or "application/json"
        self.worker = worker
        self._json: object = _NOT_JSON  # the body decoded, when it is JSON
        if body.lstrip()[:1] in (b"{", b"["):
            try:
                self._json = decode_json(body)
            except JsonDecodeError as exc:
                if exc.too_deep:
                    self.message = f"the engine answered {status} with {exc}"
                    self._json = KvgateError.payload(self)
                    self.body = _json_encode(self._json)
                    self.content_type = "application/json"

    def body_bytes(self) -> bytes:
        return self.body

    def sse_bytes(self) -> bytes:
        # Inside a stream the body must become one SSE event: kept if it is JSON (on one
        # line), else an OpenAI error event carrying its text.
        event = self.payload() if self._json is _NOT_JSON else self._json
        return b"data: " + _json_encode(event) + b"\n\ndata: [DONE]\n\n"

    def payload(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.body.decode("utf-8", "replace"),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def from_httpx(exc: httpx.HTTPError, *, worker: str) -> UpstreamError:
    """Map an httpx failure talking to ``worker`` to the most specific ``UpstreamError``."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, ResponseHeadTooLarge):
        return UpstreamProtocolError(
            "the engine's response head is too large", worker=worker, detail=detail
        )
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        return UpstreamConnectError("cannot connect to the engine", worker=worker, detail=detail)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout("the engine timed out", worker=worker, detail=detail)
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return UpstreamProtocolError(
            "the engine broke the connection", worker=worker, detail=detail
        )
    return UpstreamError("upstream failure", worker=worker, detail=detail)


def from_backend(exc: backend.BackendError) -> KvgateError:
    """Map a refusal of the backends layer (the worker registry's) to its client error."""
    if isinstance(exc, backend.WorkerNotFound):
        return WorkerNotFound(exc.worker)
    if isinstance(exc, backend.WorkerExists):
        return WorkerExists(exc.worker)
    return KvgateError(str(exc))


@contextmanager
def backend_errors() -> Iterator[None]:
    """A block whose backend errors reach the client as kvgate errors (``from_backend``)."""
    try:
        yield
    except backend.BackendError as exc:
        raise from_backend(exc) from exc


def from_scheduling(exc: scheduling.SchedulingError, *, retry_after_s: int = 1) -> KvgateError:
    """Map a refusal of the scheduler to its client error (``retry_after_s``: the
    Retry-After of the 429 and 503 answers)."""
    retry = retry_after_s
    match exc:
        case scheduling.ModelNotFound():
            return ModelNotFound(exc.model)
        case scheduling.NoHealthyWorker():
            return NoHealthyWorker(exc.model, retry_after_s=retry)
        case scheduling.QueueFull():
            return QueueFull(exc.message, code=exc.code, retry_after_s=retry)
        case scheduling.QueueTimeout():
            return QueueTimeout(exc.waited_s, retry_after_s=retry)
        case scheduling.ClientGone():
            return ClientClosed()
        case scheduling.ResponseUnknown():
            return ResponseNotFound(exc.response_id, param=exc.param)
        case scheduling.ResponseHolderGone():
            return PreviousResponseGone(exc.response_id, exc.worker)
        case scheduling.ResponseHolderUnavailable():
            return PreviousResponseUnavailable(
                exc.response_id, exc.worker, exc.why, retry_after_s=retry
            )
    return KvgateError(str(exc))


@contextmanager
def scheduling_errors(retry_after_s: int = 1) -> Iterator[None]:
    """A block whose scheduler refusals reach the client as kvgate errors."""
    try:
        yield
    except scheduling.SchedulingError as exc:
        raise from_scheduling(exc, retry_after_s=retry_after_s) from exc
