"""KV events from the engines into the index.

* wire: the msgpack format of vLLM and SGLang publishers, decoded (``EventDecoder``) and
  encoded (``EventEncoder``: the simulator, tests and benchmarks publish with it);
* ``EventFeed``: one endpoint's payloads into the ``EventIndex``, the one door of ingestion
  (natively in C when the payload's shape allows, else decoded and translated event by event
  by a ``Translator`` per data-parallel rank), counted into the metrics;
* ``Subscriber``: one endpoint's ZMQ stream (sequence numbers, gaps, replays, bounds);
* ``Subscriptions``: every worker's subscribers, joined and left with the fleet, supervised;
* ``Discovery``: where a vLLM worker publishes (``GET /kv_event_sources``), checked.
"""

from kvgate.index.events._feed import EventFeed
from kvgate.index.events._sources import Discovery, EndpointCheck, parse_sources, resolve_endpoint
from kvgate.index.events._subscriber import Subscriber
from kvgate.index.events._subscriptions import Subscriptions
from kvgate.index.events._translate import Translator, cache_salt_of
from kvgate.index.events._wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecoder,
    EventEncoder,
    KvEvent,
    decode_event_batch,
    fold_hash,
    hash_bytes,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Discovery",
    "EndpointCheck",
    "EventBatch",
    "EventDecoder",
    "EventEncoder",
    "EventFeed",
    "KvEvent",
    "Subscriber",
    "Subscriptions",
    "Translator",
    "cache_salt_of",
    "decode_event_batch",
    "fold_hash",
    "hash_bytes",
    "parse_sources",
    "resolve_endpoint",
]
