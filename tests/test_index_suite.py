"""The one Indexer test suite, run against every implementation, plus property tests."""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.index.api import ClearAll, Indexer, RemoveBlocks, StoreBlocks
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.table import ApproxIndex, EventIndex, TableKind, new_table
from kvgate.index.table._table import _Lru
from kvgate.index.types import BlockKey, PrefixMatch, Tier, WorkerId, WorkerKey

SEED = cache_seed(None, None)
BS = 2
W0 = WorkerKey(WorkerId("http://w0"), 0)
W0R1 = WorkerKey(WorkerId("http://w0"), 1)
W1 = WorkerKey(WorkerId("http://w1"), 0)
WORKERS = (W0, W0R1, W1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# Every implementation: both indexers, each over both block tables (the native core must be
# built: ``pip install -e .`` does it, and CI installs the project that way).
TABLES: tuple[TableKind, ...] = ("native", "python")


def make_event_index(kind: TableKind) -> Indexer:
    return EventIndex(max_entries=1_000_000, table=new_table(kind))


def make_approx_index(kind: TableKind) -> Indexer:
    return ApproxIndex(ttl_s=120.0, capacity=1_000_000, clock=FakeClock(), table=new_table(kind))


FACTORIES: dict[str, Callable[[TableKind], Indexer]] = {
    "event": make_event_index,
    "approx": make_approx_index,
}


def test_native_table_is_built() -> None:
    assert importlib.util.find_spec("kvgate.index._native") is not None, (
        "index._native missing: run `pip install -e .` (make does)"
    )


@pytest.fixture(params=[(name, kind) for name in sorted(FACTORIES) for kind in TABLES])
def indexer(request: pytest.FixtureRequest) -> Indexer:
    name, kind = request.param
    return FACTORIES[name](kind)


@pytest.fixture(params=TABLES)
def table_kind(request: pytest.FixtureRequest) -> TableKind:
    kind: TableKind = request.param
    return kind


def chain(tokens: Sequence[int]) -> list[BlockKey]:
    return block_keys(tokens, BS, SEED)


# A small tree of chains: B shares 4 blocks with A, C shares 6 with B, D is its own root.
A_TOKENS = list(range(24))
B_TOKENS = A_TOKENS[:8] + [100 + i for i in range(16)]
C_TOKENS = B_TOKENS[:12] + [200 + i for i in range(12)]
D_TOKENS = [300 + i for i in range(24)]
PATHS = [chain(t) for t in (A_TOKENS, B_TOKENS, C_TOKENS, D_TOKENS)]
A, B, C, D = PATHS


def store(
    index: Indexer,
    worker: WorkerKey,
    keys: Sequence[BlockKey],
    start: int,
    end: int,
    tier: Tier = Tier.GPU,
) -> None:
    parent = keys[start - 1] if start > 0 else None
    index.apply(worker, StoreBlocks(keys[start:end], tier, parent))


# --------------------------------------------------------------------------- the suite
def test_empty_index_matches_nothing(indexer: Indexer) -> None:
    assert indexer.find_matches(A) == {}
    assert indexer.find_matches([]) == {}
    assert indexer.entry_count() == 0


def test_store_then_match_prefix(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 6)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=6)}
    assert indexer.find_matches(A[:3]) == {W0: PrefixMatch(gpu=3)}
    assert indexer.find_matches(B) == {W0: PrefixMatch(gpu=4)}
    assert indexer.find_matches(D) == {}
    assert indexer.entry_count() == 6


def test_chain_extension_and_branches(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 4)
    store(indexer, W0, A, 4, 12)
    store(indexer, W1, B, 0, 10)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=12), W1: PrefixMatch(gpu=4)}
    assert indexer.find_matches(C) == {W0: PrefixMatch(gpu=4), W1: PrefixMatch(gpu=6)}


def test_dp_ranks_are_separate_domains(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 3)
    store(indexer, W0R1, A, 0, 7)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=3), W0R1: PrefixMatch(gpu=7)}
    indexer.clear_worker(W0R1)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=3)}


def test_removed_middle_block_ends_the_prefix(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 10)
    indexer.apply(W0, RemoveBlocks([A[4]]))
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=4)}
    store(indexer, W0, A, 4, 5)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=10)}


def test_removed_root_matches_nothing(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 5)
    indexer.apply(W0, RemoveBlocks([A[0]]))
    assert indexer.find_matches(A) == {}
    assert indexer.entry_count() == 4


def test_gap_store_is_not_matched_until_parent_arrives(indexer: Indexer) -> None:
    store(indexer, W0, A, 5, 9)
    assert indexer.find_matches(A) == {}
    store(indexer, W0, A, 0, 5)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=9)}


def test_tiers_form_gpu_then_cpu_then_disk_runs(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 3, Tier.GPU)
    store(indexer, W0, A, 3, 5, Tier.CPU)
    store(indexer, W0, A, 5, 7, Tier.DISK)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=3, cpu=2, disk=2)}
    # A GPU block after a CPU block counts in the CPU-or-better run.
    store(indexer, W0, A, 7, 8, Tier.GPU)
    store(indexer, W0, A, 4, 5, Tier.GPU)
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=3, cpu=2, disk=3)}


def test_same_block_in_two_tiers_counts_once_per_tier(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 4, Tier.GPU)
    store(indexer, W0, A, 0, 4, Tier.CPU)
    indexer.apply(W0, RemoveBlocks(A[2:4], Tier.GPU))
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=2, cpu=2)}
    assert indexer.entry_count() == 4


def test_clear_all_and_remove_worker(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 6)
    store(indexer, W0R1, A, 0, 6)
    store(indexer, W1, A, 0, 6)
    indexer.apply(W1, ClearAll())
    assert set(indexer.find_matches(A)) == {W0, W0R1}
    indexer.remove_worker(WorkerId("http://w0"))
    assert indexer.find_matches(A) == {}
    assert indexer.entry_count() == 0
    store(indexer, W1, A, 0, 2)
    assert indexer.find_matches(A) == {W1: PrefixMatch(gpu=2)}


def test_repeated_store_is_idempotent(indexer: Indexer) -> None:
    for _ in range(3):
        store(indexer, W0, A, 0, 6)
    assert indexer.entry_count() == 6
    indexer.apply(W0, RemoveBlocks(A[3:6]))
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=3)}


def test_unknown_removals_are_ignored(indexer: Indexer) -> None:
    indexer.apply(W0, RemoveBlocks(D))
    store(indexer, W0, A, 0, 2)
    indexer.apply(W1, RemoveBlocks(A))
    indexer.apply(W0, RemoveBlocks(A[:1], Tier.CPU))
    assert indexer.find_matches(A) == {W0: PrefixMatch(gpu=2)}


def test_many_slots_reuse_after_removal(indexer: Indexer) -> None:
    workers = [WorkerKey(WorkerId(f"http://x{i}"), 0) for i in range(40)]
    for i, worker in enumerate(workers):
        store(indexer, worker, A, 0, 1 + i % 12)
    matches = indexer.find_matches(A)
    assert {w: m.gpu for w, m in matches.items()} == {w: 1 + i % 12 for i, w in enumerate(workers)}
    for worker in workers[::2]:
        indexer.remove_worker(worker.worker)
    store(indexer, W0, A, 0, 12)
    matches = indexer.find_matches(A)
    assert matches[W0] == PrefixMatch(gpu=12)
    assert len(matches) == 21


# ------------------------------------------------------------ implementation specifics
def test_event_index_cap_prunes_leaves_first(table_kind: TableKind) -> None:
    index = EventIndex(max_entries=10, table=new_table(table_kind))
    store(index, W0, A, 0, 8)
    store(index, W1, D, 0, 8)
    assert index.entry_count() == 10
    assert index.pruned == 6
    # Pruning takes leaves of the largest domain: both keep a matchable prefix.
    matches = index.find_matches(A)
    assert matches[W0].gpu == 5
    assert index.find_matches(D)[W1].gpu == 5


def test_approx_index_ttl_and_capacity(table_kind: TableKind) -> None:
    clock = FakeClock()
    index = ApproxIndex(ttl_s=120.0, capacity=10, clock=clock, table=new_table(table_kind))
    index.record(W0, A[:6])
    clock.now += 60
    index.record(W1, A[:3])
    assert index.find_matches(A) == {W0: PrefixMatch(gpu=6), W1: PrefixMatch(gpu=3)}
    clock.now += 61
    assert index.find_matches(A) == {W1: PrefixMatch(gpu=3)}
    index.record(W1, A[:3])  # refresh
    clock.now += 100
    assert index.find_matches(A) == {W1: PrefixMatch(gpu=3)}
    index.record(W0, A)  # 12 blocks > capacity 10: leaves pruned first
    assert index.find_matches(A)[W0] == PrefixMatch(gpu=10)
    index.record(W0, D[:4])
    assert index.find_matches(A)[W0] == PrefixMatch(gpu=6)
    assert index.find_matches(D)[W0] == PrefixMatch(gpu=4)


# ------------------------------------------------------------------- property tests
@dataclass
class Reference:
    """Dict of sets: per cache domain, per key, the tiers holding it."""

    held: dict[WorkerKey, dict[BlockKey, set[Tier]]] = field(default_factory=dict)

    def apply(self, worker: WorkerKey, op: object) -> None:
        blocks = self.held.setdefault(worker, {})
        if isinstance(op, StoreBlocks):
            for key in op.keys:
                blocks.setdefault(key, set()).add(op.tier)
        elif isinstance(op, RemoveBlocks):
            for key in op.keys:
                tiers = blocks.get(key)
                if tiers is not None:
                    tiers.discard(op.tier)
                    if not tiers:
                        del blocks[key]
        elif isinstance(op, ClearAll):
            blocks.clear()

    def remove_worker(self, worker: WorkerId) -> None:
        for key in list(self.held):
            if key.worker == worker:
                del self.held[key]

    def find_matches(self, keys: Sequence[BlockKey]) -> dict[WorkerKey, PrefixMatch]:
        out = {}
        for worker, blocks in self.held.items():
            ends = []
            for allowed in ({Tier.GPU}, {Tier.GPU, Tier.CPU}, set(Tier)):
                end = 0
                while end < len(keys) and blocks.get(keys[end], set()) & allowed:
                    end += 1
                ends.append(end)
            gpu, cpu, any_ = ends
            if any_:
                out[worker] = PrefixMatch(gpu, cpu - gpu, any_ - cpu)
        return out

    def entry_count(self) -> int:
        return sum(len(b) for b in self.held.values())


worker_st = st.sampled_from(WORKERS)
tier_st = st.sampled_from(list(Tier))
path_st = st.integers(0, len(PATHS) - 1)


@st.composite
def span_st(draw: st.DrawFn) -> tuple[int, int, int]:
    path = draw(path_st)
    start = draw(st.integers(0, 11))
    end = draw(st.integers(start + 1, 12))
    return path, start, end


op_st = st.one_of(
    st.tuples(st.just("store"), worker_st, span_st(), tier_st),
    st.tuples(st.just("store"), worker_st, span_st(), st.just(Tier.GPU)),
    st.tuples(st.just("remove"), worker_st, span_st(), tier_st),
    st.tuples(st.just("remove_one"), worker_st, span_st(), tier_st),
    st.tuples(st.just("clear"), worker_st, st.just((0, 0, 1)), tier_st),
    st.tuples(st.just("remove_worker"), worker_st, st.just((0, 0, 1)), tier_st),
)


def run_ops(
    index: Indexer, ops: Iterator[tuple[str, WorkerKey, tuple[int, int, int], Tier]]
) -> None:
    ref = Reference()
    for kind, worker, (path, start, end), tier in ops:
        keys = PATHS[path]
        if kind == "store":
            parent = keys[start - 1] if start else None
            op: object = StoreBlocks(keys[start:end], tier, parent)
        elif kind == "remove":
            op = RemoveBlocks(keys[start:end], tier)
        elif kind == "remove_one":
            op = RemoveBlocks([keys[start]], tier)
        elif kind == "clear":
            op = ClearAll()
        else:
            index.remove_worker(worker.worker)
            ref.remove_worker(worker.worker)
            op = None
        if op is not None:
            index.apply(worker, op)  # type: ignore[arg-type]
            ref.apply(worker, op)
        assert index.entry_count() == ref.entry_count()
        for query in PATHS:
            for length in (1, 5, 12):
                assert dict(index.find_matches(query[:length])) == ref.find_matches(query[:length])


@pytest.mark.parametrize("kind", TABLES)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=40))
def test_event_index_equals_reference(
    kind: TableKind, ops: list[tuple[str, WorkerKey, tuple[int, int, int], Tier]]
) -> None:
    run_ops(EventIndex(table=new_table(kind)), iter(ops))


@pytest.mark.parametrize("kind", TABLES)
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, max_size=40))
def test_approx_index_equals_reference_without_expiry(
    kind: TableKind, ops: list[tuple[str, WorkerKey, tuple[int, int, int], Tier]]
) -> None:
    run_ops(ApproxIndex(clock=FakeClock(), table=new_table(kind)), iter(ops))


def test_matches_are_mappings(indexer: Indexer) -> None:
    store(indexer, W0, A, 0, 1)
    assert isinstance(indexer.find_matches(A), Mapping)


LONG = [chain(list(range(600))), chain(list(range(300)) + [9000 + i for i in range(300)])]


@pytest.mark.parametrize("kind", TABLES)
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "remove"]),
            st.sampled_from(WORKERS[:2]),
            st.integers(0, 1),
            st.integers(0, 299),
            st.integers(1, 300),
            tier_st,
        ),
        max_size=25,
    )
)
def test_long_chains_bisection_equals_walk(
    kind: TableKind, ops: list[tuple[str, WorkerKey, int, int, int, Tier]]
) -> None:
    """300-block chains: exercises bisection, orphan checks and the >64-orphan fallback."""
    index, ref = EventIndex(table=new_table(kind)), Reference()
    for kind, worker, path, start, length, tier in ops:
        keys = LONG[path]
        end = min(len(keys), start + length)
        if kind == "store":
            op: object = StoreBlocks(keys[start:end], tier, keys[start - 1] if start else None)
        else:
            op = RemoveBlocks(keys[start:end:3], tier)  # every third block: many orphans
        index.apply(worker, op)  # type: ignore[arg-type]
        ref.apply(worker, op)
        for query in LONG:
            assert dict(index.find_matches(query)) == ref.find_matches(query)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["touch", "discard", "pop", "many"]), st.integers(0, 6)),
        max_size=80,
    )
)
def test_lru_log_equals_ordered_dict(ops: list[tuple[str, int]]) -> None:
    lru, ref = _Lru(), OrderedDict[int, float]()
    for step, (kind, key) in enumerate(ops):
        if kind == "touch":
            lru.touch(key, float(step))
            ref[key] = float(step)
            ref.move_to_end(key)
        elif kind == "many":
            keys = [key, (key + 1) % 7, (key + 3) % 7]
            lru.touch_all(keys, float(step))
            for k in keys:
                ref[k] = float(step)
                ref.move_to_end(k)
        elif kind == "discard":
            lru.discard(key)
            ref.pop(key, None)
        else:
            oldest = lru.oldest()
            assert oldest == (next(iter(ref.items())) if ref else None)
            if oldest is not None:
                lru.discard(oldest[0])
                ref.popitem(last=False)
        assert len(lru) == len(ref)
        assert sorted(lru.keys()) == sorted(ref)
    for _ in range(3000):  # compaction keeps the order
        lru.touch(1, 1e9)
        ref[1] = 1e9
        ref.move_to_end(1)
    assert lru.oldest() == next(iter(ref.items()))


# ------------------------------------------------------------- a publisher forging links
ALL_KEYS = sorted({k for path in (*PATHS, *LONG) for k in path[:14]})
HONEST = (W0, W1)
ATTACKER = W0R1


@st.composite
def forged_op_st(draw: st.DrawFn) -> tuple[str, WorkerKey, list[BlockKey], BlockKey | None, Tier]:
    """Any keys in any order under any parent (itself included): what forged token ids give."""
    keys = draw(st.lists(st.sampled_from(ALL_KEYS), min_size=1, max_size=5))
    parent = draw(st.one_of(st.none(), st.sampled_from(ALL_KEYS), st.just(keys[0])))
    kind = draw(st.sampled_from(["store", "store", "remove", "clear"]))
    return kind, ATTACKER, keys, parent, draw(tier_st)


@st.composite
def honest_op_st(draw: st.DrawFn) -> tuple[str, WorkerKey, list[BlockKey], BlockKey | None, Tier]:
    worker = draw(st.sampled_from(HONEST))
    path = PATHS[draw(path_st)]
    start = draw(st.integers(0, 11))
    end = draw(st.integers(start + 1, 12))
    kind = draw(st.sampled_from(["store", "store", "remove", "clear"]))
    keys = (
        path[start:end]
        if kind == "store"
        else draw(st.sampled_from([path[start:end], [path[start]]]))
    )
    return kind, worker, keys, path[start - 1] if start else None, draw(tier_st)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(forged_op_st(), honest_op_st()), max_size=40))
def test_forged_links_change_nothing_for_other_domains(
    ops: list[tuple[str, WorkerKey, list[BlockKey], BlockKey | None, Tier]],
) -> None:
    """A domain storing blocks under parents they do not have (its own key included, or a
    parent that descends from the block) neither hangs the table nor changes another domain's
    answers; the two tables keep the same entries, records and orphans."""
    tables = [EventIndex(table=new_table("native")), EventIndex(table=new_table("python"))]
    ref = Reference()
    for kind, worker, keys, parent, tier in ops:
        op: object
        if kind == "store":
            op = StoreBlocks(keys, tier, parent)
        elif kind == "remove":
            op = RemoveBlocks(keys, tier)
        else:
            op = ClearAll()
        for index in tables:
            index.apply(worker, op)  # type: ignore[arg-type]
        ref.apply(worker, op)
        stats = [sorted((str(s.worker), s.entries, s.orphans) for s in t.stats()) for t in tables]
        assert stats[0] == stats[1]
        assert tables[0].block_count() == tables[1].block_count() <= tables[0].entry_count()
        for query in PATHS:
            want = {w: m for w, m in ref.find_matches(query).items() if w in HONEST}
            for index in tables:  # the forger's own answers are whatever its chains say
                got = dict(index.find_matches(query))
                assert {w: m for w, m in got.items() if w in HONEST} == want
    for index in tables:
        for worker in WORKERS:
            index.clear_worker(worker)
        assert index.entry_count() == index.block_count() == 0
