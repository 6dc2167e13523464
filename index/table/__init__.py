"""The block table: block key → which cache domains hold it, by tier, and the two indexers
over it (the event-fed ``EventIndex`` and the approximate ``ApproxIndex``).

Two implementations of one table protocol (``BlockTableApi``) give the same answers: the
native table (index/csrc/, the default; it also applies whole KV-event payloads in C) and the
pure-Python ``BlockTable``. ``new_table`` makes either.
"""

from kvgate.index.table._indexers import ApproxIndex, EventIndex
from kvgate.index.table._native_table import NativeBlockTable
from kvgate.index.table._protocol import BlockTableApi, TableKind, new_table
from kvgate.index.table._table import BlockTable

__all__ = [
    "ApproxIndex",
    "BlockTable",
    "BlockTableApi",
    "EventIndex",
    "NativeBlockTable",
    "TableKind",
    "new_table",
]
