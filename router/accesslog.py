"""The access log: one structured line per ``/v1`` request, on the ``kvgate.access`` logger.

Each line is an INFO record whose message is ``request`` and whose fields (``ACCESS_FIELDS``,
in that order) the formatter of ``router.logs`` renders as JSON keys, logfmt pairs or text.
Successful requests (2xx) are sampled at ``access_log_sample_rate``; every other status is
always logged. A client is named by its key's id (``client_key_id``), never by the key.
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

from kvgate.router.logs import FIELDS

log = logging.getLogger("kvgate.access")

ACCESS_FIELDS = (
    "request_id",  # x-request-id: the client's when usable, else kvgate's
    "trace_id",  # W3C trace id: kvgate's span when tracing, else the client's traceparent's
    "client",  # the client key's id (client_key_id), "-" without client keys
    "method",
    "path",
    "model",
    "stream",  # the client asked for a streamed answer
    "status",  # HTTP status the client got (499: the client left first)
    "worker",  # the worker that answered (or last tried); null when none was tried
    "policy",
    "reason",  # the policy's reason for that worker (scoring's explanation)
    "attempts",  # workers tried (attempts - 1 retries)
    "failover",  # answered by a worker other than the policy's first choice
    "prompt_tokens",  # engine usage when reported, else kvgate's count
    "predicted_cached_tokens",  # kvgate's prediction for the worker that answered
    "best_cached_tokens",  # the best prediction over every eligible worker (cache given up:
    #                        best - predicted, traded for balance)
    "engine_cached_tokens",  # usage.prompt_tokens_details.cached_tokens; null when unknown
    "output_tokens",  # usage.completion_tokens, else content events counted in the stream
    "prefill_worker",  # disaggregated: the prefill worker that answered the prefill leg
    "prefill_skipped",  # disaggregated: prefilled on the decode worker; null: not disaggregated
    "queued_ms",  # time waited in kvgate's queue before a worker was chosen; null: not queued
    "ttft_ms",  # request received -> first streamed body byte; null when not streamed
    "duration_ms",  # request received -> last byte
    "bytes_in",  # request body bytes
    "bytes_out",  # response body bytes sent to the client
)
_KEY_ID_HEX = 8


def client_key_id(key: str) -> str:
    """A key's public name: the first 8 hex digits of its SHA-256 (the key itself is never
    logged; the prefix names it in logs without revealing it)."""
    return hashlib.sha256(key.encode()).hexdigest()[:_KEY_ID_HEX]


class AccessLog:
    """Decides which requests get a line and writes it."""

    def __init__(self, sample_rate: float, rng: random.Random | None = None) -> None:
        self.sample_rate = sample_rate
        self._random = (rng if rng is not None else random.Random()).random

    def wanted(self, status: str) -> bool:
        """Log this request? Never when INFO is off; errors always; 2xx sampled."""
        if not log.isEnabledFor(logging.INFO):
            return False
        if status[:1] != "2" or self.sample_rate >= 1.0:
            return True
        return self._random() < self.sample_rate

    def write(self, fields: dict[str, Any]) -> None:
        """One record straight to the logger's handlers (``log.info`` would walk the stack
        for a caller nobody reads: most of a line's cost on the event loop)."""
        record = logging.LogRecord(log.name, logging.INFO, __file__, 0, "request", None, None)
        setattr(record, FIELDS, fields)
        log.handle(record)
