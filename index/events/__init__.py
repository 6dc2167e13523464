"""KV events from the engines into the index: wire decoding, translation to kvgate's keys,
ingestion (native when the payload's shape allows), subscribers and event-source discovery."""

from index.events._feed import BatchResult, BatchStatus, EventFeed
from index.events._sources import (
    DiscoveryError,
    DiscoveryUnreachable,
    discover,
    parse_sources,
    parse_worker_spec,
    resolve_endpoint,
)
from index.events._subscriber import Endpoints, Subscriber
from index.events._translate import Outcome, Translator, cache_salt_of
from index.events._wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventDecoder,
    KvEvent,
    decode_event_batch,
    encode_event_batch,
    fold_hash,
)

__all__ = [
    "AllBlocksCleared",
    "BatchResult",
    "BatchStatus",
    "BlockRemoved",
    "BlockStored",
    "DiscoveryError",
    "DiscoveryUnreachable",
    "Endpoints",
    "EventBatch",
    "EventDecodeError",
    "EventDecoder",
    "EventFeed",
    "KvEvent",
    "Outcome",
    "Subscriber",
    "Translator",
    "cache_salt_of",
    "decode_event_batch",
    "discover",
    "encode_event_batch",
    "fold_hash",
    "parse_sources",
    "parse_worker_spec",
    "resolve_endpoint",
]
