"""BoundedMemo: bounded by forgetting, keys forgotten on demand."""

from __future__ import annotations

import pytest

from kvgate.index.memo import BoundedMemo


def test_a_full_memo_is_emptied_before_the_next_insertion() -> None:
    memo: BoundedMemo[int, str] = BoundedMemo(2)
    assert memo.put(1, "a") == "a"
    memo.put(2, "b")
    assert (memo.get(1), memo.get(2), len(memo)) == ("a", "b", 2)
    memo.put(3, "c")
    assert (memo.get(1), memo.get(2), memo.get(3), len(memo)) == (None, None, "c", 1)


def test_forget_where_drops_only_the_matching_keys() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(8)
    for worker in ("w1", "w2"):
        for model in ("m1", "m2"):
            memo.put((worker, model), 0)
    memo.forget_where(lambda key: key[0] == "w1")
    assert len(memo) == 2
    assert memo.get(("w1", "m1")) is None and memo.get(("w2", "m2")) == 0


def test_a_memo_needs_room_for_one() -> None:
    with pytest.raises(ValueError):
        BoundedMemo(0)
