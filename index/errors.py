"""The index layer's errors: one tree (the router decides what, if anything, a client sees).

::

    KvIndexError
    ├── TokenizeError (ValueError)     a prompt that cannot be tokenized (bad template input,
    │                                  ids out of range...): the next keying mode is used
    ├── TemplateError (ValueError)     a chat template that raised or could not be rendered
    ├── EventDecodeError (ValueError)  a payload that is not a KV-event batch
    ├── JsonDecodeError (ValueError)   JSON that is not valid, too deep or not the expected
    │                                  shape (index/jsonsafe.py: every layer's decoder)
    ├── EngineCallError                an engine call without a whole answer (unreachable,
    │                                  too slow, too large)
    └── DiscoveryError (RuntimeError)  a worker that does not say where it publishes events
        └── DiscoveryUnreachable       ... because it did not answer (yet): asked again later

Nothing here is raised to a client: a prompt that cannot be keyed is routed without keys, a
bad payload costs that payload (docs/security-events.md).
"""

from __future__ import annotations


class KvIndexError(Exception):
    """Base of every error the index layer raises on purpose."""


class TokenizeError(KvIndexError, ValueError):
    """The prompt cannot be tokenized (bad template input, ids out of range...)."""


class TemplateError(KvIndexError, ValueError):
    """The chat template raised (``raise_exception``) or could not be rendered."""


class EventDecodeError(KvIndexError, ValueError):
    """A payload that is not a KV-event batch."""


class JsonDecodeError(KvIndexError, ValueError):
    """JSON from outside that cannot be used: not valid, nested too deeply (``too_deep``),
    or not the shape asked for."""

    def __init__(self, message: str, *, too_deep: bool = False) -> None:
        super().__init__(message)
        self.too_deep = too_deep


class EngineCallError(KvIndexError):
    """A call to an engine (``/kv_event_sources``, ``/tokenize``) got no whole answer: it could
    not be reached, took longer than its timeout, or answered more than its byte cap."""


class DiscoveryError(KvIndexError, RuntimeError):
    """The worker does not publish KV events (or answered something else)."""


class DiscoveryUnreachable(DiscoveryError):
    """The worker did not answer (yet): worth asking again later."""
