"""The pure-Python block table: block key → which cache domains hold it, by tier.

One of the two implementations of the table protocol (index/table/_protocol.py), selected by
``IndexConfig.table = "python"``; the native table (index/csrc/table.h) is the other and the
default. They follow the same rules step for step and give the same answers (the tests run one
suite against both and against a plain dict-of-sets model, the reference); this one is the
readable statement of those rules, and runs where a C build is unwanted.

Layout (see docs/block-keys.md, "Index layout"):

* per held block key, in plain ``dict[int, int]`` maps (which the garbage collector does not
  track, so a million entries add no GC pauses): a bit mask with 3 bits per cache-domain slot
  (one per tier), the parent key (roots have none), the first child key and, for branch
  points only, the other children. A key's record goes with its last holder (its children's
  ancestry is unknown from then on).
* per slot: an LRU log of its keys (the tail is the most recent; chains are touched leaf first
  so that roots are the most recent and leaves are pruned first), each key's depth in the
  slot's own chains, the keys it stored under another parent than the recorded one
  (*contested*), tier counters, and the *orphans* of each presence class: held blocks whose
  parent is not held in that class (plus markers for blocks with many children it lost).

Publishers are not trusted (docs/security-events.md): table.h's header says how the links stay
acyclic and every operation bounded whatever keys they send; this table follows the same rules.

Exact matching in O(log n) lookups: a presence class (GPU; CPU-or-better; any) of a slot is
prefix-closed along every chain unless one of the chain's blocks is an orphan of that class.
With no orphan on the query chain, "block i is held" is monotone in i, so the first missing
block of every slot is found by bisection, all slots at once (the class masks only lose bits
along the chain). A slot with an orphan on the chain (or too many orphans to check) is
walked block by block instead. Either way the result equals a sequential walk.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from kvgate.index.memo import BoundedMemo
from kvgate.index.types import BlockKey, PrefixMatch, SlotStats, Tier, WorkerKey

_UNKNOWN_PARENT = -1
"""Parent of a record whose ancestry is unknown (stored after a block nobody held, or whose
parent's record went): an orphan wherever it is held."""

_BITS = 3  # one bit per tier in each slot's group
_GROUP = 0b111
# Presence classes: bit 0 GPU, bit 1 CPU-or-better, bit 2 any tier.
_CLASS_OF_TIERS = [(t & 1) | (bool(t & 0b011) << 1) | (bool(t) << 2) for t in range(8)]
_CLASSES = (0, 1, 2)
_MAX_ORPHANS_CHECKED = 64
_MASK_INTERN_LIMIT = 4096
_MATCH_MEMO_LIMIT = 4096
_NO_DEPTH = -1
SECOND_CHANCES = 64
MAX_CHILDREN_SCANNED = 64
"""Per operation, at most this many children of a block are looked at (table.h)."""
MAX_ANCESTRY_CHECKED = 64
"""Links followed up from a new parent before giving a record of unknown ancestry one."""


class _Lru:
    """Keys in least-recently-touched order, in storage the garbage collector never scans.

    A touch appends (key, stamp) to flat arrays; ``_records`` counts each key's records still
    in the log (positive: the key is live, negative: discarded), so the values are small
    cached ints. A record at the head is the key's latest touch exactly when it is the key's
    only record. The log is compacted when stale records outnumber live keys.
    """

    __slots__ = ("_head", "_keys", "_live", "_records", "_stamps")

    def __init__(self) -> None:
        self._records: dict[int, int] = {}
        self._keys = array("Q")
        self._stamps = array("d")
        self._head = 0
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: int) -> bool:
        return self._records.get(key, 0) > 0

    def keys(self) -> list[int]:
        return [key for key, count in self._records.items() if count > 0]

    def touch(self, key: int, stamp: float) -> None:
        self._count(key)
        self._keys.append(key)
        self._stamps.append(stamp)
        self._maybe_compact()

    def _count(self, key: int) -> None:
        records = self._records
        count = records.get(key, 0)
        if count > 0:
            records[key] = count + 1
        else:
            records[key] = 1 - count
            self._live += 1

    def touch_all(self, keys: Sequence[int], stamp: float) -> None:
        """``touch`` each of ``keys`` in order (the last is the most recent)."""
        records = self._records
        fresh = dict.fromkeys(keys, 1)
        if len(fresh) == len(keys) and records.keys().isdisjoint(fresh):
            records.update(fresh)
            self._live += len(keys)
        else:
            for key in keys:
                self._count(key)
        self._keys.extend(keys)
        self._stamps.extend(repeat(stamp, len(keys)))
        self._maybe_compact()

    def discard(self, key: int) -> None:
        count = self._records.get(key, 0)
        if count > 0:
            self._records[key] = -count
            self._live -= 1

    def oldest(self) -> tuple[int, float] | None:
        records, keys = self._records, self._keys
        head, end = self._head, len(keys)
        try:
            while head < end:
                key = keys[head]
                count = records[key]
                if count == 1:
                    return key, self._stamps[head]
                head += 1
                if count == -1:
                    del records[key]
                else:
                    records[key] = count - 1 if count > 0 else count + 1
            return None
        finally:
            self._head = head

    def _maybe_compact(self) -> None:
        if len(self._keys) - self._head > 2 * self._live + 1024:
            self._compact()

    def _compact(self) -> None:
        """Keep each live key's latest record only."""
        records = self._records
        latest: dict[int, int] = {}
        keys = self._keys
        for i in range(self._head, len(keys)):
            if records[keys[i]] > 0:
                latest[keys[i]] = i
        order = sorted(latest.values())
        self._keys = array("Q", [keys[i] for i in order])
        self._stamps = array("d", [self._stamps[i] for i in order])
        self._records = dict.fromkeys(self._keys, 1)
        self._head = 0


@dataclass(slots=True)
class _Slot:
    worker: WorkerKey
    lru: _Lru = field(default_factory=_Lru)
    tier_counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    orphans: tuple[dict[int, int], dict[int, int], dict[int, int]] = field(
        default_factory=lambda: ({}, {}, {})
    )
    depth: dict[int, int] = field(default_factory=dict)  # depths that cannot be derived
    contested: set[int] = field(default_factory=set)  # stored under another parent


class BlockTable:
    """Blocks held per cache domain, with LRU order per domain and exact prefix matching."""

    def __init__(self) -> None:
        self._mask: dict[int, int] = {}  # held key -> holders (3 bits per slot)
        self._parent: dict[int, int] = {}  # key -> parent key (absent: a root)
        self._marked: set[int] = set()  # keys some slot may hold a marker orphan of
        self._child: dict[int, int] = {}  # key -> its first child
        self._more: dict[int, set[int]] = {}  # key -> its other children (branch points)
        self._slots: list[_Slot | None] = []
        self._slot_of: dict[WorkerKey, int] = {}
        self._free_slots: list[int] = []
        self._masks = BoundedMemo[int, int](_MASK_INTERN_LIMIT)  # one int object per mask
        self._matches = BoundedMemo[tuple[int, int, int], PrefixMatch](_MATCH_MEMO_LIMIT)
        self._entries = 0
        self._gpu_bits = 0  # bit 3s of every slot s
        self._cpu_bits = 0  # bit 3s+1 of every slot s

    # ----------------------------------------------------------------- slots
    def _slot(self, worker: WorkerKey) -> int:
        slot = self._slot_of.get(worker)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slots[slot] = _Slot(worker)
        else:
            slot = len(self._slots)
            self._slots.append(_Slot(worker))
            self._gpu_bits |= 1 << (slot * _BITS)
            self._cpu_bits |= 2 << (slot * _BITS)
        self._slot_of[worker] = slot
        return slot

    def _state(self, slot: int) -> _Slot:
        state = self._slots[slot]
        assert state is not None
        return state

    def workers(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def entry_count(self) -> int:
        return self._entries

    def block_count(self) -> int:
        return len(self._mask)

    def slot_entries(self, worker: WorkerKey) -> int:
        slot = self._slot_of.get(worker)
        return 0 if slot is None else len(self._state(slot).lru)

    def stats(self) -> list[SlotStats]:
        out = []
        for worker, slot in self._slot_of.items():
            state = self._state(slot)
            by_tier = {tier: state.tier_counts[tier] for tier in Tier}
            orphans = sum(len(o) for o in state.orphans)
            out.append(SlotStats(worker, len(state.lru), by_tier, orphans))
        return out

    def _intern(self, mask: int) -> int:
        found = self._masks.get(mask)
        return self._masks.put(mask, mask) if found is None else found

    def holds(self, worker: WorkerKey, key: BlockKey) -> bool:
        """Whether the cache domain holds ``key`` in any tier."""
        slot = self._slot_of.get(worker)
        return slot is not None and (self._mask.get(key, 0) >> (slot * _BITS)) & _GROUP != 0

    def held_keys(self, worker: WorkerKey) -> list[int]:
        slot = self._slot_of.get(worker)
        return [] if slot is None else self._state(slot).lru.keys()

    # ----------------------------------------------------------------- store
    def store(
        self,
        worker: WorkerKey,
        keys: Sequence[BlockKey],
        tier: Tier,
        parent: BlockKey | None,
        stamp: float = 0.0,
    ) -> None:
        """Hold ``keys`` (a chain after ``parent``) in ``tier``; stamp them in LRU order."""
        if not keys:
            return
        if not isinstance(keys, list):  # e.g. array('Q') from the event path: one int object
            keys = list(keys)  # per key, shared by every map below
        slot = self._slot(worker)
        state = self._state(slot)
        shift = slot * _BITS
        fresh: dict[int, int] = dict.fromkeys(keys, self._intern((1 << tier) << shift))
        if len(fresh) == len(keys) and self._mask.keys().isdisjoint(fresh) and parent not in fresh:
            self._store_fresh(state, shift, keys, fresh, tier=tier, parent=parent)
        else:
            depth = self._first_depth(state, shift, parent)
            prev: int | None = parent
            for i, key in enumerate(keys):
                at = _NO_DEPTH if depth < 0 else depth + i
                self._store_one(state, shift, key, prev=prev, depth=at, tier=tier)
                prev = key
        state.lru.touch_all(keys[::-1], stamp)

    def _first_depth(self, state: _Slot, shift: int, parent: int | None) -> int:
        """Depth of the block after ``parent`` in the slot's own chain (-1: not known there)."""
        if parent is None:
            return 0
        if not (self._mask.get(parent, 0) >> shift) & _GROUP:
            return _NO_DEPTH
        depth = self._depth(state, shift, parent)
        return _NO_DEPTH if depth < 0 else depth + 1

    def _depth(self, state: _Slot, shift: int, key: int) -> int:
        """The depth of a key the slot holds, in its own chains (table.h's Node.depth).

        Kept only where it cannot be derived: a key stored after the parent on its record,
        which the slot holds, is one deeper than that parent. Derived depths are written down
        as they are computed (each key once while held), and a parent the slot loses writes
        its children's first (``_drop``), so this walk is linear over a slot's lifetime."""
        explicit = state.depth
        path: list[int] = []
        while (found := explicit.get(key)) is None:
            parent = self._parent.get(key)
            if (
                parent is None
                or parent == _UNKNOWN_PARENT
                or key in state.contested
                or not (self._mask.get(parent, 0) >> shift) & _GROUP
            ):
                found = explicit[key] = _NO_DEPTH  # not derivable (> 64 children lost it)
                break
            path.append(key)
            key = parent
        for walked in reversed(path):
            found = explicit[walked] = _NO_DEPTH if found < 0 else found + 1
        return found

    def _store_fresh(
        self,
        state: _Slot,
        shift: int,
        keys: list[BlockKey],
        fresh: dict[int, int],
        *,
        tier: Tier,
        parent: BlockKey | None,
    ) -> None:
        """A chain of distinct keys nobody holds yet: bulk inserts, no per-key Python work
        (depths are derived: only the first key's may have to be written down)."""
        n = len(keys)
        masks = self._mask
        linked = parent is not None and parent in masks  # before the chain's keys exist
        if parent is None:
            state.depth[keys[0]] = 0
        elif not linked or not (masks[parent] >> shift) & _GROUP:
            state.depth[keys[0]] = self._first_depth(state, shift, parent)
        masks.update(fresh)
        state.tier_counts[tier] += n
        self._entries += n
        if n > 1:
            tail = keys[1:]
            self._parent.update(zip(tail, keys, strict=False))
            self._child.update(zip(keys, tail, strict=False))
        if parent is None:
            return
        first = keys[0]
        classes = _CLASS_OF_TIERS[1 << tier]
        if linked:
            self._parent[first] = parent
            self._link(first, parent)
            if not classes & ~_CLASS_OF_TIERS[(self._mask[parent] >> shift) & _GROUP]:
                return  # its parent is held in its classes, it has no children: no orphan
        else:
            self._parent[first] = _UNKNOWN_PARENT
            state.contested.add(first)
        self._on_gain(state, shift, first, classes)

    def _store_one(
        self, state: _Slot, shift: int, key: int, *, prev: int | None, depth: int, tier: Tier
    ) -> None:
        """One block of a chain, after ``prev`` (None: the chain's root)."""
        masks = self._mask
        mask = masks.get(key)
        contested = self._link_stored(key, mask is None, prev)
        tiers = 0 if mask is None else (mask >> shift) & _GROUP
        newly = changed = False
        if tiers:
            newly, changed = self._node_stored(state, shift, key, depth, contested)
        elif contested:
            state.contested.add(key)
            state.depth[key] = depth
        elif (
            prev is None
            or self._parent.get(key) != prev
            or not (masks.get(prev, 0) >> shift) & _GROUP
        ):
            state.depth[key] = depth  # a root, or after a block the slot does not hold
        tier_bit = 1 << tier
        if not tiers & tier_bit:
            masks[key] = self._intern((mask or 0) | (tier_bit << shift))
            state.tier_counts[tier] += 1
            if not tiers:
                self._entries += 1
            gained = _CLASS_OF_TIERS[tiers | tier_bit] & ~_CLASS_OF_TIERS[tiers]
            if gained:
                self._on_gain(state, shift, key, gained)
        if changed:
            self._refresh_orphan(state, shift, key, newly)

    def _link_stored(self, key: int, created: bool, prev: int | None) -> bool:
        """Set ``key``'s links if its record is new or of unknown ancestry and that cannot close
        a cycle (table.h's link_stored); whether its parent on record differs from ``prev``."""
        parents = self._parent
        if created or parents.get(key) == _UNKNOWN_PARENT:
            if prev is None:
                parents.pop(key, None)  # known now: a root
                return False
            acyclic = prev != key if created else not self._may_descend(prev, key)
            if acyclic and prev in self._mask:
                parents[key] = prev
                self._link(key, prev)
                return False
            parents[key] = _UNKNOWN_PARENT
            return True
        parent = parents.get(key)
        return parent is not None if prev is None else parent != prev

    def _may_descend(self, key: int, ancestor: int) -> bool:
        """Whether ``ancestor`` lies on the chain up from ``key`` (only the first
        MAX_ANCESTRY_CHECKED links are followed: past them, yes)."""
        parents = self._parent
        for _ in range(MAX_ANCESTRY_CHECKED + 1):
            if key == ancestor:
                return True
            parent = parents.get(key)
            if parent is None or parent == _UNKNOWN_PARENT:
                return False
            key = parent
        return True

    def _node_stored(
        self, state: _Slot, shift: int, key: int, depth: int, contested: bool
    ) -> tuple[bool, bool]:
        """A held block stored again: contested if this store is, no depth if it gives
        another; whether it became contested, and whether anything changed."""
        known = self._depth(state, shift, key)  # written down: it may not be derivable now
        newly = contested and key not in state.contested
        if newly:
            state.contested.add(key)
        changed = newly
        if depth not in (_NO_DEPTH, known):
            state.depth[key] = depth if known == _NO_DEPTH else _NO_DEPTH
            changed = True
        return newly, changed

    def _link(self, key: int, parent: int) -> None:
        """Record ``key`` as a child of ``parent`` (an existing record)."""
        first = self._child.get(parent)
        if first is None:
            self._child[parent] = key
        elif first != key:
            self._more.setdefault(parent, set()).add(key)

    def _unlink(self, key: int, parent: int) -> None:
        more = self._more.get(parent)
        if self._child.get(parent) == key:
            if more:
                self._child[parent] = more.pop()
                if not more:
                    del self._more[parent]
            else:
                self._child.pop(parent, None)
        elif more is not None:
            more.discard(key)
            if not more:
                del self._more[parent]

    def _children(self, key: int) -> list[int]:
        first = self._child.get(key)
        if first is None:
            return []
        more = self._more.get(key)
        return [first, *more] if more else [first]

    def _children_upto(self, key: int) -> list[int] | None:
        """The children of ``key``, or None when there are more than MAX_CHILDREN_SCANNED."""
        more = self._more.get(key)
        if more is not None and len(more) >= MAX_CHILDREN_SCANNED:
            return None
        return self._children(key)

    def _orphan_classes(self, state: _Slot, shift: int, key: int) -> int:
        """The classes in which the held ``key`` is an orphan of the slot (bit per class)."""
        if key in state.contested:
            return 7
        parent = self._parent.get(key)
        if parent is None:
            return 0
        if parent == _UNKNOWN_PARENT:
            return 7
        return 7 & ~_CLASS_OF_TIERS[(self._mask.get(parent, 0) >> shift) & _GROUP]

    def _on_gain(self, state: _Slot, shift: int, key: int, gained: int) -> None:
        """``key`` is now held in ``gained``: its own orphan entry is set or cleared, its held
        children are orphans no more (table.h's on_gain)."""
        orphaned = self._orphan_classes(state, shift, key)
        kids = self._children_upto(key)
        masks = self._mask
        for cls in _CLASSES:
            if not gained >> cls & 1:
                continue
            orphans = state.orphans[cls]
            if orphaned >> cls & 1:
                orphans[key] = self._depth(state, shift, key)
            else:
                orphans.pop(key, None)
            if not kids or not orphans:
                continue
            for kid in kids:
                held = _CLASS_OF_TIERS[(masks.get(kid, 0) >> shift) & _GROUP]
                if held >> cls & 1 and kid not in state.contested:
                    orphans.pop(kid, None)

    def _refresh_orphan(self, state: _Slot, shift: int, key: int, contested: bool) -> None:
        """A held key's node changed: contested now (an orphan in every class it is held in),
        or only its depth (its orphan entries, if any, get the new one): which entries exist
        never depends on a depth (table.h's refresh_orphan)."""
        held = _CLASS_OF_TIERS[(self._mask[key] >> shift) & _GROUP]
        depth = self._depth(state, shift, key)
        for cls in _CLASSES:
            orphans = state.orphans[cls]
            if held >> cls & 1 and (contested or key in orphans):
                orphans[key] = depth

    # ---------------------------------------------------------------- remove
    def remove(self, worker: WorkerKey, keys: Sequence[BlockKey], tier: Tier) -> None:
        """``keys`` are no longer held in ``tier`` (unknown keys are ignored)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        state = self._state(slot)
        for key in keys:
            self._drop(state, slot, key, 1 << tier)

    def _drop(self, state: _Slot, slot: int, key: int, tier_bits: int) -> None:
        mask = self._mask.get(key)
        if mask is None:
            return
        shift = slot * _BITS
        tiers = (mask >> shift) & _GROUP
        dropped = tiers & tier_bits
        if not dropped:
            return
        left = tiers & ~dropped
        # a parent's depth (while the slot still holds it): its children derive theirs from it
        depth = self._depth(state, shift, key) if key in self._child else _NO_DEPTH
        mask = self._mask[key] = self._intern(mask & ~(dropped << shift))
        for tier in Tier:
            if dropped >> tier & 1:
                state.tier_counts[tier] -= 1
        if not left:
            self._entries -= 1
            state.lru.discard(key)
            state.depth.pop(key, None)
            if state.contested:
                state.contested.discard(key)
            if key in self._child:
                self._write_down_children(state, shift, key, depth)
        lost = _CLASS_OF_TIERS[tiers] & ~_CLASS_OF_TIERS[left]
        if lost:
            self._on_loss(state, shift, key, depth, lost)
        if not mask:
            self._drop_record(key)

    def _write_down_children(self, state: _Slot, shift: int, key: int, depth: int) -> None:
        """The slot no longer holds ``key``: the depths of its children (up to
        MAX_CHILDREN_SCANNED) can no longer be derived from it, so they are written down."""
        kids = self._children_upto(key)
        masks, explicit = self._mask, state.depth
        for kid in kids or ():
            if (masks.get(kid, 0) >> shift) & _GROUP and kid not in explicit:
                explicit[kid] = _NO_DEPTH if depth < 0 else depth + 1

    def _on_loss(self, state: _Slot, shift: int, key: int, depth: int, lost: int) -> None:
        """``key`` left ``lost``: its held children there are orphans now, or past
        MAX_CHILDREN_SCANNED children ``key`` stays as a marker orphan (table.h's on_loss)."""
        kids = self._children_upto(key)
        if kids is None:
            self._marked.add(key)
        masks = self._mask
        for cls in _CLASSES:
            if not lost >> cls & 1:
                continue
            orphans = state.orphans[cls]
            orphans.pop(key, None)
            if kids is None:
                orphans[key] = depth
                continue
            for kid in kids:
                if _CLASS_OF_TIERS[(masks.get(kid, 0) >> shift) & _GROUP] >> cls & 1:
                    orphans[kid] = self._depth(state, shift, kid)

    def _drop_record(self, key: int) -> None:
        """The last holder of ``key`` is gone: its record goes, its children lose their
        parent (their ancestry is unknown from now on)."""
        kids = self._children(key)
        if key in self._marked:
            self._marked.discard(key)
            self._unmark(key, kids)
        for kid in kids:
            self._parent[kid] = _UNKNOWN_PARENT
        self._child.pop(key, None)
        self._more.pop(key, None)
        del self._mask[key]
        parent = self._parent.pop(key, None)
        if parent is not None and parent != _UNKNOWN_PARENT:
            self._unlink(key, parent)

    def _unmark(self, key: int, kids: list[int]) -> None:
        """Slots holding a marker of ``key``: orphans of the children they hold instead."""
        masks = self._mask
        for slot, state in enumerate(self._slots):
            if state is None:
                continue
            shift = slot * _BITS
            for cls in _CLASSES:
                orphans = state.orphans[cls]
                if orphans.pop(key, None) is None:
                    continue
                for kid in kids:
                    if _CLASS_OF_TIERS[(masks.get(kid, 0) >> shift) & _GROUP] >> cls & 1:
                        orphans[kid] = self._depth(state, shift, kid)

    # ----------------------------------------------------------------- clear
    def clear(self, worker: WorkerKey) -> None:
        """Forget every block of one cache domain (the slot is released)."""
        slot = self._slot_of.pop(worker, None)
        if slot is None:
            return
        state = self._state(slot)
        group = _GROUP << (slot * _BITS)
        masks = self._mask
        dead: list[int] = []
        for key in state.lru.keys():  # noqa: SIM118 - _Lru is not a dict
            mask = masks[key] = self._intern(masks[key] & ~group)
            if not mask:
                dead.append(key)
        self._entries -= len(state.lru)
        self._slots[slot] = None
        self._free_slots.append(slot)
        for key in dead:
            self._drop_record(key)

    # ----------------------------------------------------------------- prune
    def oldest(self, worker: WorkerKey) -> tuple[int, float] | None:
        """The least recently stored (key, stamp) of a cache domain."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return None
        return self._state(slot).lru.oldest()

    def evict(self, worker: WorkerKey, key: int) -> None:
        """Drop ``key`` from every tier of a cache domain."""
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._drop(self._state(slot), slot, key, _GROUP)

    def prune_leaf(self, worker: WorkerKey, second_chances: int = SECOND_CHANCES) -> bool:
        """Evict the least recently stored leaf of a cache domain (bounded second chances:
        an entry whose child is still held goes back to the recent end, up to that many)."""
        slot = self._slot_of.get(worker)
        return slot is not None and self._prune_slot(slot, second_chances)

    def prune_to(self, max_entries: int) -> int:
        """The cap's pruning rule (table.h's ``table_prune_to``): while more than
        ``max_entries`` entries are held, evict the least recently stored leaf of the largest
        domain (the lowest slot on ties). How many went."""
        pruned = 0
        while self._entries > max_entries:
            slot = self._largest_slot()
            if slot is None or not self._prune_slot(slot, SECOND_CHANCES):
                break
            pruned += 1
        return pruned

    def _prune_slot(self, slot: int, second_chances: int) -> bool:
        state = self._state(slot)
        lru = state.lru
        shift = slot * _BITS
        for _ in range(second_chances + 1):
            oldest = lru.oldest()
            if oldest is None:
                return False
            key, stamp = oldest
            if not self._has_held_child(key, shift):
                break
            lru.touch(key, stamp)
        self._drop(state, slot, key, _GROUP)
        return True

    def _has_held_child(self, key: int, shift: int) -> bool:
        kids = self._children_upto(key)
        if kids is None:
            return True  # too many to look at: taken as held
        masks = self._mask
        return any((masks.get(child, 0) >> shift) & _GROUP for child in kids)

    def _largest_slot(self) -> int | None:
        """The slot with the most entries, the lowest on ties (table.h's ``table_largest``)."""
        best, most = None, -1
        for slot, state in enumerate(self._slots):
            if state is not None and len(state.lru) > most:
                best, most = slot, len(state.lru)
        return best

    # ----------------------------------------------------------------- match
    def find_matches(self, keys: Sequence[BlockKey]) -> dict[WorkerKey, PrefixMatch]:
        """Per cache domain holding ``keys[0]``: its contiguous matched prefix by tier."""
        if not keys:
            return {}
        holders = self._mask.get(keys[0], 0)
        if not holders:
            return {}
        slots = [(slot, self._state(slot)) for slot in self._slots_in(holders)]
        walked: dict[int, tuple[int, int, int]] = {}
        safe_groups = 0
        for slot, state in slots:
            if self._chain_has_orphan(state, keys):
                walked[slot] = self._walk(slot, keys)
            else:
                safe_groups |= _GROUP << (slot * _BITS)
        ends = self._bisect(keys, safe_groups) if safe_groups else {}
        result: dict[WorkerKey, PrefixMatch] = {}
        for slot, state in slots:
            if slot in walked:
                gpu, cpu, any_ = walked[slot]
            else:
                base = slot * _BITS
                gpu, cpu, any_ = ends.get(base, 0), ends.get(base + 1, 0), ends.get(base + 2, 0)
            if any_:
                result[state.worker] = self._match(gpu, cpu - gpu, any_ - cpu)
        return result

    def _match(self, gpu: int, cpu: int, disk: int) -> PrefixMatch:
        """Shared immutable ``PrefixMatch`` objects (a frozen dataclass is slow to build)."""
        runs = (gpu, cpu, disk)
        found = self._matches.get(runs)
        return self._matches.put(runs, PrefixMatch(*runs)) if found is None else found

    @staticmethod
    def _slots_in(mask: int) -> Iterator[int]:
        slot = 0
        while mask:
            if mask & _GROUP:
                yield slot
            mask >>= _BITS
            slot += 1

    @staticmethod
    def _chain_has_orphan(state: _Slot, keys: Sequence[BlockKey]) -> bool:
        gpu, cpu, any_ = state.orphans
        if not (gpu or cpu or any_):
            return False
        n = len(keys)
        for orphans in state.orphans:
            if len(orphans) > _MAX_ORPHANS_CHECKED:
                return True
            for key, depth in orphans.items():
                if depth < 0 or (depth < n and keys[depth] == key):
                    return True
        return False

    def _walk(self, slot: int, keys: Sequence[BlockKey]) -> tuple[int, int, int]:
        """Sequential walk of one slot: the end of its GPU, CPU-or-better and any-tier runs."""
        shift = slot * _BITS
        get = self._mask.get
        ends = [-1, -1, -1]
        for i, key in enumerate(keys):
            classes = _CLASS_OF_TIERS[(get(key, 0) >> shift) & _GROUP]
            for cls in _CLASSES:
                if ends[cls] < 0 and not classes >> cls & 1:
                    ends[cls] = i
            if ends[2] >= 0:
                break
        n = len(keys)
        gpu, cpu, any_ = (n if end < 0 else end for end in ends)
        return gpu, cpu, any_

    def _classes(self, mask: int) -> int:
        gpu = mask & self._gpu_bits
        return mask | (gpu << 1) | (gpu << 2) | ((mask & self._cpu_bits) << 1)

    def _bisect(self, keys: Sequence[BlockKey], groups: int) -> dict[int, int]:
        """For every class bit of ``groups`` held at keys[0]: the index of its first miss."""
        get = self._mask.get
        memo: dict[int, int] = {0: 0}  # holder mask -> its class bits within ``groups``

        def classes_of(mask: int) -> int:
            value = memo[mask] = self._classes(mask) & groups
            return value

        first = get(keys[0], 0)
        ends: dict[int, int] = {}
        stack = [(0, classes_of(first), len(keys), 0)]
        pop, push = stack.pop, stack.append
        while stack:
            lo, v_lo, hi, v_hi = pop()
            if v_lo == v_hi:
                continue
            if hi - lo == 1:
                _record_ends(ends, v_lo & ~v_hi, hi)
                continue
            mid = (lo + hi) >> 1
            mask = get(keys[mid], 0)
            v_mid = memo.get(mask)
            if v_mid is None:
                v_mid = classes_of(mask)
            v_mid &= v_lo
            push((mid, v_mid, hi, v_hi & v_mid))
            push((lo, v_lo, mid, v_mid))
        return ends


def _record_ends(ends: dict[int, int], lost: int, index: int) -> None:
    while lost:
        low = lost & -lost
        ends[low.bit_length() - 1] = index
        lost ^= low
