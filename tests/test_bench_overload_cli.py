"""The overload command's repeats: one slice replayed, or another session layout each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.bench import cli
from kvgate.bench.compare import CompareConfig, RouterRun
from kvgate.bench.overload import PointResult
from kvgate.bench.traces import TraceRequest


def _trace(path: Path) -> None:
    rows = [
        {"session_id": f"s{i}", "timestamp": 1000 * k, "input_length": 512, "output_length": 4,
         "hash_ids": [i, k]}
        for i in range(6)
        for k in range(3)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> list[list[float]]:
    trace = tmp_path / "t.jsonl"
    _trace(trace)
    seen: list[list[float]] = []

    def fake_point(
        runs: list[RouterRun], reqs: list[TraceRequest], cfg: CompareConfig, **_: object
    ) -> list[PointResult]:
        seen.append([r.arrival_s for r in reqs])
        return []

    monkeypatch.setattr(cli, "run_point", fake_point)
    argv = ["overload", "--trace", str(trace), "--routers", "kv", "--points", "1",
            "--repeat", "3", "--out", str(tmp_path / "out"), "--no-progress", *extra]  # fmt: skip
    assert cli.main(argv) == 0
    return seen


def test_repeats_replay_one_slice_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _starts(tmp_path, monkeypatch)
    assert len(seen) == 3
    assert seen[0] == seen[1] == seen[2]


def test_seed_per_repeat_lays_each_repeat_out_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _starts(tmp_path, monkeypatch, "--seed-per-repeat", "--seed", "5")
    assert len(seen) == 3 and len({tuple(s) for s in seen}) == 3
    again = _starts(tmp_path, monkeypatch, "--seed", "6")  # repeat 2 above used seed 6
    assert again[0] == seen[1]
