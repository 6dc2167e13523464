"""The block table: block key → which cache domains hold it, by tier, and the two indexers
over it (the event-fed ``EventIndex`` and the approximate ``ApproxIndex``).

Two implementations of one table protocol (``BlockTableApi``) give the same answers: the
native table (index/csrc/, the default) and the pure-Python ``BlockTable``.
"""

from index.table._indexers import ApproxIndex, EventIndex
from index.table._native_table import NativeBlockTable
from index.table._protocol import (
    BlockTableApi,
    TableKind,
    default_kind,
    native_available,
    new_table,
)
from index.table._table import BlockTable

__all__ = [
    "ApproxIndex",
    "BlockTable",
    "BlockTableApi",
    "EventIndex",
    "NativeBlockTable",
    "TableKind",
    "default_kind",
    "native_available",
    "new_table",
]
