"""One ext_proc stream: one HTTP request Envoy asks kvgate to place, from its head to the
end of its answer.

In order (anything else from the peer is a protocol error that ends this stream alone)::

    request_headers   the head; ``GET /v1/models`` is answered here from the registry
    request_body...   the body, read whole within ``max_body_bytes`` (413) and
                      ``client.body_timeout_s`` (408), in the body mode Envoy announces
                      (full-duplex streamed: kvgate sends the body back itself; buffered)
      -> the pick     parse, then ``Placer.place`` (keys, match, rank, admission: the stream
                      stays open while the request is queued); the answer to the head sets
                      ``x-gateway-destination-endpoint`` and the ``envoy.lb`` metadata (the
                      same list), then the body goes back; a refusal is an ImmediateResponse
                      with kvgate's OpenAI-style error (429 shedding, 503 nobody can serve)
    response_headers  the status, and the endpoint that served (a fallback moves the load)
    response_body...  the answer as Envoy passes it: usage, first token, answer blocks
    (stream ends)     load released, metrics and the access-log line written

Every wait on the peer is bounded (the request by ``client.body_timeout_s``, the answer by
``upstream.response_timeout_s``), and so is the number of messages before the pick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, cast

import grpc
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import Response

from kvgate.index.types import WorkerId
from kvgate.router.epp import wire
from kvgate.router.epp.config import EppSettings
from kvgate.router.epp.exchange import Exchange
from kvgate.router.epp.placement import Ask, Placer
from kvgate.router.epp.request import KEYED_PATHS, Head, parse
from kvgate.router.errors import (
    ClientClosed,
    KvgateError,
    ModelNotFound,
    NoHealthyWorker,
    PathNotPassedThrough,
    PayloadTooLarge,
    RequestTimeout,
)
from kvgate.router.gateway import Gateway
from kvgate.router.observe import Observation
from kvgate.router.requests import client_timeout_s, normalised_path
from kvgate.scheduling.affinity import ClientKeyId

log = logging.getLogger("kvgate.epp")

# (request, response) body modes in which kvgate sends the body and the answer back itself
# (it may ask for usage upstream and hide it from the client)
_REWRITABLE = frozenset({(wire.FULL_DUPLEX, wire.FULL_DUPLEX), (wire.BUFFERED, wire.STREAMED)})
MAX_REQUEST_MESSAGES = 65_536  # messages before the pick (body pieces, trailers)
_MAX_REQUEST_ID = 128
OUTCOMES = ("placed", "refused", "client_gone", "protocol_error", "timeout")


class ProtocolError(Exception):
    """The peer broke the ext_proc exchange (wrong message, wrong order, too many)."""


class _Timeout(Exception):
    """The peer sent nothing in time."""


class EppMetrics:
    """``kvgate_epp_streams_total{outcome}``: how each ext_proc stream ended."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.streams = Counter(
            "kvgate_epp_streams_total",
            "ext_proc streams by how they ended: placed (endpoints given), refused (an "
            "OpenAI-style error answered), client_gone (before the pick), protocol_error "
            "(a peer breaking the protocol), timeout (a peer silent too long)",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.streams.labels(outcome)

    def ended(self, outcome: str) -> None:
        self.streams.labels(outcome).inc()


class EppService:
    """What every stream shares; which answers kvgate reads in full (one in
    ``answer_sample``, or all when Envoy cannot be told to skip an answer's body)."""

    __slots__ = ("_count", "gateway", "metrics", "placer", "settings", "skip_answer")

    def __init__(
        self, gateway: Gateway, settings: EppSettings, placer: Placer, metrics: EppMetrics
    ) -> None:
        self.gateway = gateway
        self.settings = settings
        self.placer = placer
        self.metrics = metrics
        self.skip_answer = wire.skip_answer_body(wire.BUFFERED)
        self._count = 0

    def reads_answer(self, modes: tuple[int, int]) -> bool:
        """Whether kvgate reads this request's answer past its head."""
        if not wire.can_skip_answer(modes):
            return True
        self._count = (self._count + 1) % self.settings.answer_sample
        return self._count == 0


class EppStream:
    """One ext_proc stream (``run`` is the RPC's response iterator)."""

    def __init__(self, service: EppService, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._service = service
        self._gateway = service.gateway
        self._context = context
        self._gone = asyncio.Event()  # the RPC ended (Envoy cancelled it: the client left)
        context.add_done_callback(cast(Any, self._ended))
        self._exchange: Exchange | None = None
        self._outcome = "client_gone"

    def _ended(self, _: object) -> None:
        self._gone.set()

    async def _disconnected(self) -> None:
        """Returns when the RPC ends (for the queue: the client left while queued)."""
        await self._gone.wait()

    async def run(self, requests: AsyncIterator[wire.Message]) -> AsyncIterator[wire.Message]:
        reader = _Reader(requests)
        try:
            async for message in self._converse(reader):
                yield message
        except ProtocolError as exc:
            self._outcome = "protocol_error"
            log.info("ext_proc peer %s broke the protocol: %s", self._context.peer(), exc)
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except _Timeout:
            self._outcome = "timeout"
        finally:
            self._service.metrics.ended(self._outcome)
            if self._exchange is not None:
                self._exchange.close()

    # -- the request ----------------------------------------------------------------------
    async def _converse(self, reader: _Reader) -> AsyncIterator[wire.Message]:
        settings = self._service.settings
        first = await reader.next(settings.client.header_timeout_s)
        if first is None:
            return
        if wire.message_kind(first) != "request_headers":
            raise ProtocolError(f"expected request_headers first, got {wire.message_kind(first)}")
        received_at = time.perf_counter()
        modes = wire.body_modes(first) or (wire.FULL_DUPLEX, wire.FULL_DUPLEX)
        headers = wire.headers_of(first.request_headers)
        head = Head.of(headers)
        request_id = self._request_id(headers)
        observation = self._gateway.observer.begin(
            request_id, head.method, head.path, wire.headers_list(headers), received_at
        )
        try:
            early = self._head(first, head, modes, observation)
        except KvgateError as exc:
            self._outcome = "refused"
            yield from_refusal(self._gateway, exc, observation)
            return
        if isinstance(early, Response):  # answered here (the model list)
            self._outcome = "placed"
            observation.finish(str(early.status_code))
            yield from_response(early, request_id)
            return
        if early is not None:  # buffered mode: Envoy sends the body once the head is answered
            yield early
        try:
            picked = await self._pick(reader, first, head, modes, observation)
        except KvgateError as exc:
            self._outcome = "client_gone" if isinstance(exc, ClientClosed) else "refused"
            yield from_refusal(self._gateway, exc, observation)
            return
        except _Timeout:
            self._outcome = "timeout"
            limit = settings.client.body_timeout_s
            error = RequestTimeout(f"the request body did not arrive within {limit:g} s")
            yield from_refusal(self._gateway, error, observation)
            return
        self._outcome = "placed"
        for message in picked.messages:
            yield message
        async for message in self._answer(reader, modes[1]):
            yield message

    def _head(
        self, first: wire.Message, head: Head, modes: tuple[int, int], observation: Observation
    ) -> Response | wire.Message | None:
        """What the head alone decides: the client's key (401), the model list (answered
        here), a path serve does not pass through (404), a body mode kvgate cannot place in
        (500); the answer Envoy needs before it sends a buffered body."""
        observation.client = self._client_key(head)
        if head.lists_models:
            return self._models(head)
        if head.path not in KEYED_PATHS:  # passed through as serve passes it: if allowed
            path = normalised_path(head.path)
            if not self._gateway.pass_paths.permits(head.method, path):
                raise PathNotPassedThrough(head.method, path)
        if first.request_headers.end_of_stream:
            return None
        if modes[0] not in (wire.FULL_DUPLEX, wire.BUFFERED):
            raise KvgateError(
                "kvgate epp needs the ext_proc request body mode FULL_DUPLEX_STREAMED or BUFFERED",
                code="epp_misconfigured",
            )
        return wire.HEAD_CONTINUE if modes[0] == wire.BUFFERED else None

    async def _pick(
        self,
        reader: _Reader,
        first: wire.Message,
        head: Head,
        modes: tuple[int, int],
        observation: Observation,
    ) -> _Picked:
        """The body read, parsed and placed; the answers that send the request on."""
        settings = self._service.settings
        request_mode = modes[0]
        body: bytes = b""
        trailers = False
        if not first.request_headers.end_of_stream:
            limits = (settings.max_body_bytes, settings.client.body_timeout_s)
            body, trailers = await reader.body(*limits)
        gateway, key = self._gateway, ClientKeyId(observation.client)
        stored_model, holder = None, None
        if head.path not in KEYED_PATHS:  # (an allowed path: _head saw to it)
            stored_model, holder = gateway.stored_response(normalised_path(head.path), key)
        reads_answer = self._service.reads_answer(modes)
        can_rewrite = reads_answer and (request_mode, modes[1]) in _REWRITABLE
        parsed = parse(
            head,
            body,
            capture_usage=settings.capture_usage,
            can_rewrite=can_rewrite,
            model=stored_model,
        )
        observation.parsed(parsed.model, len(body), stream=parsed.stream)
        if parsed.previous_response_id is not None:
            previous = parsed.previous_response_id
            holder = gateway.holder_of(previous, key, "previous_response_id")
        ask = Ask(
            model=parsed.model,
            prompt=parsed.prompt,
            session=gateway.namespaced(key, parsed.session),  # in its client key's space
            max_tokens=parsed.max_tokens,
            key=key,
            timeout_s=client_timeout_s(head.headers),
            queued=parsed.queued,
            only=holder,
            among=self._allowed(first, head, parsed.model),
            size=len(body),
        )
        placement = await self._service.placer.place(ask, self._disconnected)
        answer_tap = gateway.scheduler.affinity.tap(key) if parsed.responses else None
        exchange = Exchange(
            self._gateway,
            placement,
            parsed,
            observation,
            answer_tap=answer_tap,
            reads_answer=reads_answer,
        )
        self._exchange = exchange
        if observation.queued is None:
            observation.queued = placement.waited_s
        endpoints = [wire.endpoint_of(worker.url) for worker in placement.order]
        sent = parsed.body if parsed.body is not None else body
        messages = list(
            _pick_messages(
                endpoints,
                exchange.upstream_headers(body_changed=parsed.body is not None),
                sent,
                changed=parsed.body is not None,
                request_mode=request_mode,
                had_body=not first.request_headers.end_of_stream,
                trailers=trailers,
            )
        )
        return _Picked(messages)

    def _request_id(self, headers: dict[str, str]) -> str:
        given = headers.get("x-request-id")
        if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
            return given
        return self._gateway.request_ids.new()

    def _client_key(self, head: Head) -> str:
        """The client key id (401 without a valid key when kvgate has client keys)."""
        return self._gateway.check_client(_as_request(head))

    def _models(self, head: Head) -> Response:
        request = _as_request(head)
        if head.path == "/v1/models":
            return self._gateway.list_models(request)
        return self._gateway.get_model(request, head.path.removeprefix("/v1/models/"))

    def _allowed(self, first: wire.Message, head: Head, model: str) -> frozenset[WorkerId] | None:
        """The workers the request may go to: the proxy's subset hint, narrowed by the
        conformance suite's forced pick (when enabled); None: any. 503 when the proxy
        allows endpoints of which kvgate knows none."""
        allowed: set[WorkerId] | None = None
        hint = wire.subset_hint(first)
        if hint is not None:
            allowed = self._workers_at(hint)
        forced = head.headers.get(wire.TEST_SELECTION)
        if forced and self._service.settings.conformance_headers:
            chosen = self._workers_at(wire.split_endpoints(forced))
            allowed = chosen if allowed is None else allowed & chosen
        if allowed is not None and not allowed:
            raise NoHealthyWorker(model, retry_after_s=self._service.settings.retry_after_s)
        return frozenset(allowed) if allowed is not None else None

    def _workers_at(self, endpoints: list[str]) -> set[WorkerId]:
        """Workers at these ``ip:port`` endpoints (a bare IP: any port of that host)."""
        wanted = set(endpoints)
        found: set[WorkerId] = set()
        for worker in self._gateway.registry:
            endpoint = wire.endpoint_of(worker.url)
            host = endpoint.rpartition(":")[0].strip("[]")
            if endpoint in wanted or host in wanted:
                found.add(worker.id)
        return found

    # -- the answer -----------------------------------------------------------------------
    async def _answer(self, reader: _Reader, response_mode: int) -> AsyncIterator[wire.Message]:
        exchange = self._exchange
        assert exchange is not None
        limit = self._service.settings.upstream.response_timeout_s
        deadline = time.monotonic() + limit
        ended = False
        while (message := await reader.next(deadline - time.monotonic())) is not None:
            kind = wire.message_kind(message)
            if kind == "response_headers":
                yield self._answer_head(message, exchange)
                if message.response_headers.end_of_stream and not ended:
                    ended = True
                    exchange.ended()
            elif kind == "response_body":
                piece = message.response_body
                out = exchange.chunk(piece.body)
                if piece.end_of_stream and not ended:
                    ended = True
                    out += exchange.ended()
                for answer in _body_answers(
                    piece.body, out, response_mode, end=piece.end_of_stream
                ):
                    yield answer
            elif kind == "response_trailers":
                if not ended:
                    ended = True
                    exchange.ended()
                yield wire.ANSWER_TRAILERS_CONTINUE
            elif kind == "request_trailers":
                yield wire.REQUEST_TRAILERS_CONTINUE
            else:
                raise ProtocolError(f"unexpected {kind} after the pick")

    def _answer_head(self, message: wire.Message, exchange: Exchange) -> wire.Message:
        headers = wire.headers_of(message.response_headers)
        status_text = headers.get(":status", "")
        status = int(status_text) if status_text.isdigit() and len(status_text) == 3 else None
        served = wire.served_endpoint(message)
        exchange.served(served, status)
        told = exchange.client_headers()
        if self._service.settings.conformance_headers:
            told.append((wire.TEST_SERVED, served or ""))
        skip = None if exchange.reads_answer else self._service.skip_answer
        return wire.headers_continue(request=False, set_headers=told, mode_override=skip)


@dataclass(frozen=True, slots=True)
class _Picked:
    messages: list[wire.Message]


class _Reader:
    """The peer's messages, each awaited within a limit; at most ``MAX_REQUEST_MESSAGES``
    before the pick."""

    def __init__(self, requests: AsyncIterator[wire.Message]) -> None:
        self._requests = aiter(requests)

    async def next(self, limit_s: float) -> wire.Message | None:
        """The next message; None when the peer ended the stream; ``_Timeout`` past
        ``limit_s`` seconds."""
        if limit_s <= 0:
            raise _Timeout
        try:
            async with asyncio.timeout(limit_s):
                return await anext(self._requests)
        except StopAsyncIteration:
            return None
        except TimeoutError as exc:
            raise _Timeout from exc

    async def body(self, limit: int, timeout_s: float) -> tuple[bytes, bool]:
        """The request body, whole (``PayloadTooLarge`` past ``limit`` bytes); and whether
        it ended with trailers."""
        deadline = time.monotonic() + timeout_s
        pieces: list[bytes] = []
        size = 0
        for _ in range(MAX_REQUEST_MESSAGES):
            message = await self.next(deadline - time.monotonic())
            if message is None:
                raise ClientClosed
            kind = wire.message_kind(message)
            if kind == "request_trailers":
                return b"".join(pieces), True
            if kind != "request_body":
                raise ProtocolError(f"expected request_body, got {kind}")
            piece = message.request_body
            size += len(piece.body)
            if size > limit:
                raise PayloadTooLarge(limit)
            pieces.append(piece.body)
            if piece.end_of_stream:
                return b"".join(pieces), False
        raise ProtocolError(f"more than {MAX_REQUEST_MESSAGES} messages before the body ended")


def _pick_messages(
    endpoints: list[str],
    rewrite: wire.Rewrite,
    body: bytes,
    *,
    changed: bool,
    request_mode: int,
    had_body: bool,
    trailers: bool,
) -> Iterator[wire.Message]:
    """The answers that send the request on to ``endpoints`` (the body, when kvgate holds
    it, sent back with them)."""
    if request_mode == wire.BUFFERED and had_body:
        yield wire.pick_with_body(endpoints, rewrite, body if changed else None)
    else:
        yield wire.pick_headers(endpoints, rewrite)
        if had_body and request_mode == wire.FULL_DUPLEX:
            yield from wire.streamed_bodies(body, request=True, end=not trailers)
    if trailers:
        yield wire.REQUEST_TRAILERS_CONTINUE


def _body_answers(original: bytes, out: bytes, mode: int, *, end: bool) -> Iterator[wire.Message]:
    """The answer to a piece of the response body: sent back in full-duplex streamed mode,
    else a continue (replacing the piece only when kvgate changed it)."""
    if mode == wire.FULL_DUPLEX:
        if out or end:
            yield from wire.streamed_bodies(out, request=False, end=end)
        return
    yield wire.PIECE_CONTINUE if out == original else wire.body_continue(request=False, body=out)


def from_refusal(gateway: Gateway, error: KvgateError, observation: Observation) -> wire.Message:
    """``error`` as the client's answer (an ImmediateResponse), recorded as ``serve`` records
    a refusal."""
    model = "unknown" if isinstance(error, ModelNotFound) else observation.model
    gateway.metrics.route("none", model).answered(str(error.status))
    if error.status >= 500:
        log.warning("%s: %s", observation.request_id, error.message)
    message = wire.refusal(error, observation.request_id)
    observation.wrote(len(error.body_bytes()))
    observation.finish(str(error.status))
    return message


def from_response(response: Response, request_id: str) -> wire.Message:
    """A response kvgate answers itself (the model list) as an ImmediateResponse."""
    headers = [(k.decode(), v.decode()) for k, v in response.raw_headers if k != b"content-length"]
    headers.append(("x-request-id", request_id))
    return wire.immediate(response.status_code, bytes(response.body), headers, "kvgate_models")


def _as_request(head: Head) -> Request:
    """The request head as the gateway's handlers read one (client key, query)."""
    return Request(
        {
            "type": "http",
            "method": head.method,
            "path": head.path,
            "query_string": head.query.encode(),
            "headers": wire.headers_list(head.headers),
        }
    )
