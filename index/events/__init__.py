"""KV events from the engines into the index.

* wire: the msgpack format of vLLM and SGLang publishers, decoded (``EventDecoder``) and
  encoded (``EventEncoder``: the simulator, tests and benchmarks publish with it);
* ``EventFeed``: one endpoint's payloads into the ``EventIndex``, the one door of ingestion
  (natively in C when the payload's shape allows, else decoded and translated event by event
  by a ``Translator`` per data-parallel rank), counted into the metrics;
* ``Subscriber``: one endpoint's ZMQ stream (sequence numbers, gaps, replays, bounds);
* ``discover``: where a vLLM worker publishes (``GET /kv_event_sources``).
"""

from index.events._feed import EventFeed
from index.events._sources import discover, parse_sources, resolve_endpoint
from index.events._subscriber import Endpoints, Subscriber
from index.events._translate import Translator, cache_salt_of
from index.events._wire import (
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
    "Endpoints",
    "EventBatch",
    "EventDecoder",
    "EventEncoder",
    "EventFeed",
    "KvEvent",
    "Subscriber",
    "Translator",
    "cache_salt_of",
    "decode_event_batch",
    "discover",
    "fold_hash",
    "hash_bytes",
    "parse_sources",
    "resolve_endpoint",
]
