"""The prefill leg of a disaggregated request: vLLM's ``kv_transfer_params`` protocol, and
SGLang's bootstrap protocol.

When a model's ready workers include prefill and decode workers (``scheduling.pd``), the
gateway routes the request's decode leg as an ordinary exchange among the decode workers
(``Proxy``: queue, retries before the first token, the client's stream) and gives it a
``TwoLegs``: before each decode attempt the proxy asks it for the body to send
(``body_for``). It plans the legs for that decode worker (``scheduling.pd.plan_legs``: skip
the prefill leg when local prefill is no dearer), and otherwise runs the prefill leg:

    POST <prefill worker><path>  client body + kv_transfer_params {do_remote_decode: true,
                                 ...}, max_tokens 1, stream false (same X-Request-Id)
        -> its answer's kv_transfer_params
    decode body = client body + those kv_transfer_params

A failed prefill attempt is retried on the next prefill worker (fresh ranking, failed
workers left out); when none answers, the decode worker prefills the prompt itself (the
request is never lost to the prefill tier). A failed decode attempt re-runs the prefill leg
for the next decode worker. Every leg runs in the exchange's task: a client that leaves
cancels whichever leg is running. A client's own ``kv_transfer_params`` never reaches an
engine (``strip_transfer_params``).

A prefill worker with a bootstrap address (``WorkerConfig.bootstrap``: SGLang's) gets
SGLang's protocol instead: both legs carry ``bootstrap_host``, ``bootstrap_port`` (the prefill
worker's) and a random ``bootstrap_room``, and are sent at once (the decode worker waits for
the KV of that room); the prefill answer is read and dropped. A failed prefill fails its
decode attempt, whose retry runs both legs again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from kvgate.backends.registry import Worker
from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json
from kvgate.index.types import WorkerId
from kvgate.router.commit import Reason, failure_reason
from kvgate.router.errors import from_httpx
from kvgate.router.observe import Observation
from kvgate.router.proxy import Proxy
from kvgate.router.upstream import BodyTooLarge
from kvgate.router.usage import usage_from_body
from kvgate.scheduling.errors import NoHealthyWorker
from kvgate.scheduling.grant import Grant
from kvgate.scheduling.pd import LegPlan, plan_legs
from kvgate.scheduling.routing import Routed
from kvgate.scheduling.scheduler import Scheduler
from kvgate.scoring.config import KvPolicyConfig

if TYPE_CHECKING:
    from kvgate.router.tracing import RequestSpans

log = logging.getLogger("kvgate.pd")

TRANSFER_PARAMS = "kv_transfer_params"
_TRANSFER_KEY = b'"kv_transfer_params"'
ENGINE_ONLY = frozenset({TRANSFER_PARAMS, "bootstrap_host", "bootstrap_port", "bootstrap_room"})
"""Request members only kvgate may send an engine: where a leg's KV comes from."""
_ENGINE_ONLY_KEYS = (_TRANSFER_KEY, b'"bootstrap_')
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill leg asks of a vLLM prefill worker: prefill, keep the blocks for a
decode worker to fetch, and answer with where they are."""
_CLIENT_ERROR = "http_4xx"  # a prefill answer's 4xx: the request's fault, not retried
_MAX_PREFILL_ANSWER = 1 << 20  # a one-token answer and its transfer parameters
_ENCODE = msgspec.json.Encoder()


def strip_transfer_params(raw: bytes, data: dict[str, Any]) -> bytes:
    """``raw`` (decoding to ``data``) without a client's ``kv_transfer_params`` or SGLang
    ``bootstrap_*`` fields (``ENGINE_ONLY``; removed from ``data`` too): a malformed one
    kills a vLLM decode worker, a mismatched one gets a wrong answer, and either makes an
    engine fetch KV from where the client says. Re-encoded only when the body has one."""
    if not any(key in raw for key in _ENGINE_ONLY_KEYS) or ENGINE_ONLY.isdisjoint(data):
        return raw
    for name in ENGINE_ONLY:
        data.pop(name, None)
    return _ENCODE.encode(data)


def prefill_body(data: dict[str, Any]) -> bytes:
    """The prefill leg's body: the client's request, one token, not streamed, marked for a
    remote decode."""
    body = {k: v for k, v in data.items() if k not in {"stream_options", TRANSFER_PARAMS}}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body[TRANSFER_PARAMS] = REMOTE_DECODE
    return _ENCODE.encode(body)


def bootstrap_prefill_body(data: dict[str, Any]) -> bytes:
    """SGLang's prefill leg: the client's request, not streamed (its answer is dropped)."""
    body = {k: v for k, v in data.items() if k not in {"stream_options", TRANSFER_PARAMS}}
    body["stream"] = False
    return _ENCODE.encode(body)


def with_members(body: bytes, members: dict[str, Any]) -> bytes:
    """``body`` (a JSON object without any of ``members``' names) carrying them, its own
    bytes kept."""
    start = body.index(b"{") + 1
    added = _ENCODE.encode(members)[1:-1]
    rest = body[start:].lstrip()
    return body[:start] + added + (b"," if not rest.startswith(b"}") else b"") + body[start:]


def with_transfer_params(body: bytes, params: dict[str, Any]) -> bytes:
    """``body`` (a JSON object without ``kv_transfer_params``) carrying ``params``."""
    return with_members(body, {TRANSFER_PARAMS: params})


class _PrefillFailed(Exception):
    """One prefill attempt failed (its reason and detail)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class TwoLegs:
    """One disaggregated request's prefill legs, run by its exchange before each decode
    attempt (``router.proxy.AttemptBody``)."""

    def __init__(
        self,
        proxy: Proxy,
        scheduler: Scheduler,
        config: KvPolicyConfig,
        *,
        data: dict[str, Any],
        path: str,
        request_id: str,
        headers: list[tuple[bytes, bytes]],
        key: str,
        spans: RequestSpans | None = None,
    ) -> None:
        self._proxy = proxy
        self._spans = spans  # the request's trace: a span per prefill leg
        self._scheduler = scheduler
        self._config = config
        self._prefill_body = prefill_body(data)
        self._bootstrap_body = bootstrap_prefill_body(data)
        self._pending: asyncio.Task[None] | None = None  # a bootstrap prefill leg
        self._room: dict[str, Any] = {}  # its bootstrap fields
        self._path = path
        self._request_id = request_id
        self._headers = headers
        self._key = key
        self.plan: LegPlan | None = None
        self.prefill_worker: str | None = None  # the prefill worker that answered, if any
        self._predicted: dict[WorkerId, int] = {}
        self._prompt_tokens: int | None = None  # the last prefill answer's count

    @staticmethod
    def plan_for(
        scheduler: Scheduler, config: KvPolicyConfig, routed: Routed, worker: WorkerId | None = None
    ) -> tuple[LegPlan, Routed | None]:
        """The plan for decode worker ``worker`` (default: the chosen one) of ``routed``
        (the decode leg's ranking), and the prefill leg's ranking made for it now (None: no
        prefill worker ready)."""
        try:
            prefill: Routed | None = scheduler.route_leg(routed, "prefill")
        except NoHealthyWorker:
            prefill = None
        return plan_legs(routed, worker or routed.chosen, prefill, config), prefill

    async def body_for(self, worker: Worker, routed: Routed, body: bytes) -> bytes:
        """The body of the decode attempt on ``worker``: ``body`` as it is (prefill leg
        skipped, or failed on every prefill worker), or carrying the prefill leg's answer."""
        self._cancel_pending()
        plan, ranked = self.plan_for(self._scheduler, self._config, routed, worker.id)
        self.plan, self.prefill_worker = plan, None
        metrics = self._proxy.metrics
        self._predicted[worker.id] = plan.decode_cached_tokens
        if plan.skipped or ranked is None:
            metrics.pd_legs.labels("prefill", "skipped").inc()
            log.debug("%s: prefill leg skipped: %s", self._request_id, plan.reason)
            return body
        prefill = self._proxy.registry.find(ranked.chosen)
        if prefill is not None and prefill.config.bootstrap is not None:
            self._bootstrap(ranked, prefill)
            metrics.pd_transferred.inc(plan.transfer_blocks * routed.request.block_size)
            return with_members(body, self._room)
        params = await self._prefill(ranked)
        if params is None:  # every prefill worker failed: prefilled where it decodes
            self._predicted[worker.id] = routed.predicted_cached_tokens(worker.id)
            return body
        metrics.pd_transferred.inc(plan.transfer_blocks * routed.request.block_size)
        counted = self._prompt_tokens
        if counted is not None:  # the engine's count: every whole block before the last token
            size = routed.request.block_size
            sent = (counted - 1) // size * size
            self._predicted[worker.id] = max(sent, routed.predicted_cached_tokens(worker.id))
        if not params:  # a connector that needs none (it finds the KV by the prompt)
            return body
        return with_transfer_params(body, params)

    def predicted(self, worker: WorkerId) -> int | None:
        """Tokens ``worker`` (a decode worker tried) should report cached."""
        return self._predicted.get(worker)

    def observe(self, observation: Observation, status: str) -> None:
        """The exchange is over: the decode leg's outcome, the access log's fields."""
        self._cancel_pending()
        outcome = "ok" if status == "200" else "failed"
        self._proxy.metrics.pd_legs.labels("decode", outcome).inc()
        plan = self.plan
        observation.pd = (self.prefill_worker, plan.skipped if plan is not None else None)

    async def _prefill(self, routed: Routed) -> dict[str, Any] | None:
        """The prefill leg (``routed``: its ranking), retried on the next prefill worker (at
        most ``1 + upstream.max_failover`` attempts); its answer's ``kv_transfer_params``
        (empty when it gave none), or None when every attempt failed."""
        scheduler, proxy = self._scheduler, self._proxy
        grant = Grant(routed, router=scheduler.router, ledger=scheduler.ledger, key=self._key)
        tried: list[WorkerId] = []
        for _ in range(1 + proxy.config.max_failover):
            worker = proxy.registry.find(grant.routed.chosen)
            if worker is not None and worker.healthy:
                try:
                    params = await self._prefill_on(worker, grant)
                except _PrefillFailed as exc:
                    proxy.metrics.pd_legs.labels("prefill", "failed").inc()
                    log.info("%s: prefill leg failed on %s: %s", self._request_id, worker.url,
                             exc.detail)  # fmt: skip
                    if exc.reason == _CLIENT_ERROR:  # the request's: the decode worker says so
                        return None
                else:
                    proxy.metrics.pd_legs.labels("prefill", "ok").inc()
                    self.prefill_worker = worker.url
                    return params
            tried.append(grant.routed.chosen)
            if grant.reroute(tried) is None:
                break
        return None

    def _bootstrap(self, routed: Routed, worker: Worker) -> None:
        """SGLang's prefill leg on ``worker`` (``routed``'s choice), sent beside the decode
        attempt."""
        host, port = worker.config.bootstrap or ("", 0)
        room = random.getrandbits(63)
        self._room = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
        scheduler = self._scheduler
        grant = Grant(routed, router=scheduler.router, ledger=scheduler.ledger, key=self._key)
        body = with_members(self._bootstrap_body, self._room)
        pending = asyncio.get_running_loop().create_task(self._bootstrap_leg(worker, grant, body))
        pending.add_done_callback(self._bootstrap_done)
        self._pending = pending

    def _bootstrap_done(self, task: asyncio.Task[None]) -> None:
        """A bootstrap prefill leg that broke unexpectedly costs its request, never silence."""
        if not task.cancelled() and (error := task.exception()) is not None:
            self._proxy.metrics.pd_legs.labels("prefill", "failed").inc()
            log.error("%s: prefill leg broke", self._request_id, exc_info=error)

    async def _bootstrap_leg(self, worker: Worker, grant: Grant, body: bytes) -> None:
        metrics = self._proxy.metrics
        try:
            await self._send_prefill(worker, grant, body)
        except _PrefillFailed as exc:
            metrics.pd_legs.labels("prefill", "failed").inc()
            log.info("%s: prefill leg failed on %s: %s", self._request_id, worker.url, exc.detail)
            return
        metrics.pd_legs.labels("prefill", "ok").inc()
        self.prefill_worker = worker.url

    def _cancel_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.done():
            pending.cancel()

    async def _prefill_on(self, worker: Worker, grant: Grant) -> dict[str, Any]:
        answer = await self._send_prefill(worker, grant, self._prefill_body)
        return self._answer(answer)

    async def _send_prefill(self, worker: Worker, grant: Grant, body: bytes) -> bytes:
        """One prefill attempt on ``worker``: its whole answer (``_PrefillFailed``)."""
        proxy = self._proxy
        headers = [
            *self._headers,
            (b"x-request-id", self._request_id.encode()),
            (b"accept-encoding", b"identity"),
        ]
        authorization = worker.config.authorization()
        if authorization is not None:
            headers.append((b"authorization", authorization.encode()))
        ticket = grant.begin(worker.id)  # ends when the prefill answer is in
        started, failure = time.perf_counter(), "cancelled"
        try:
            try:
                response = await proxy.upstream.request(
                    proxy.origin(worker), "POST", self._path, headers, body
                )
                try:
                    answer = await response.aread(_MAX_PREFILL_ANSWER)
                finally:
                    await response.aclose()
            except httpx.HTTPError as exc:
                error = from_httpx(exc, worker=worker.url)
                proxy.mark_failed(worker, failure_reason(exc), error.detail)
                raise _PrefillFailed(failure_reason(exc), error.detail) from exc
            except BodyTooLarge as exc:
                raise _PrefillFailed(Reason.TOO_LARGE, "prefill answer too large") from exc
            ticket.first_token()
            grant.sent(worker.id)
            if response.status_code >= 500:
                detail = f"answered {response.status_code}"
                proxy.registry.record_failure(worker, detail)
                raise _PrefillFailed(Reason.HTTP_5XX, detail)
            if response.status_code >= 400:  # the request's fault: the decode worker says so
                raise _PrefillFailed(_CLIENT_ERROR, f"answered {response.status_code}")
            proxy.registry.record_ok_response(worker)
            usage = _usage(answer)
            self._prompt_tokens = usage.prompt_tokens if usage is not None else None
            if usage is not None:
                ticket.complete(usage.prompt_tokens, usage.cached_tokens)
                self._count_cache(worker, grant.routed, usage.cached_tokens)
            failure = ""
            return answer
        except _PrefillFailed as exc:
            failure = exc.detail
            raise
        finally:
            ticket.finish()
            if self._spans is not None:
                self._spans.leg(worker.url, started, failure or None)

    def _answer(self, answer: bytes) -> dict[str, Any]:
        try:
            data = decode_json(answer)
        except JsonDecodeError as exc:
            raise _PrefillFailed(Reason.BAD_ANSWER, f"its answer: {exc}") from exc
        params = data.get(TRANSFER_PARAMS) if isinstance(data, dict) else None
        if params is None:
            return {}
        if not isinstance(params, dict):
            raise _PrefillFailed(Reason.BAD_ANSWER, "its kv_transfer_params is not an object")
        return params

    def _count_cache(self, worker: Worker, routed: Routed, engine_cached: int | None) -> None:
        metrics, label = self._proxy.metrics, self._proxy.worker_label(worker)
        metrics.pd_prefill_predicted.labels(label).inc(routed.predicted_cached_tokens(worker.id))
        if engine_cached is not None:
            metrics.pd_prefill_engine_cached.labels(label).inc(engine_cached)


def _usage(answer: bytes) -> Any:
    try:
        return usage_from_body(answer)
    except JsonDecodeError:
        return None
