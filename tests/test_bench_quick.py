"""Quick benchmark (CI): a small trace slice, 2 simulated replicas, kvgate policies only.

Checks that the whole pipeline (cold fleet per policy, router, replay, summary, table, plots)
produces complete, sane output. No performance assertion: which policy wins is measured in
docs/benchmarks.md, never asserted here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvgate.bench.cli import main as bench_main
from kvgate.bench.replay import RequestRecord

REPO = Path(__file__).resolve().parent.parent


def read_records(path: Path) -> list[RequestRecord]:
    with path.open(encoding="utf-8") as fh:
        return [RequestRecord(**json.loads(line)) for line in fh if line.strip()]


SHARED_TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"
POLICIES = ("kv", "round_robin", "least_loaded", "session")


def _trace_args() -> list[str]:
    if SHARED_TRACE.is_file():  # a real slice when ../shared/traces is beside the repo
        return ["--trace", str(SHARED_TRACE), "--max-requests", "24", "--token-scale", "0.25"]
    return ["--trace", "synthetic", "--syn-sessions", "4", "--syn-turns", "5", "--session-rate",
            "4", "--max-gap", "1"]  # fmt: skip


@pytest.mark.slow
def test_quick_compare_produces_complete_sane_output(tmp_path: Path) -> None:
    argv = [
        "compare", *_trace_args(),
        "--replicas", "2", "--speedup", "4", "--capacity-blocks", "4096",
        "--routers", ",".join(POLICIES),
        "--drain-timeout", "45", "--no-progress", "--out", str(tmp_path),
    ]  # fmt: skip
    assert bench_main(argv) == 0

    for name in ("table.md", "summaries.json", "ttft_cdf.png", "hit_rate.png",
                 "replica_load.png", "command.txt"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "summaries.json").read_text())
    runs = data["runs"]
    assert [r["label"] for r in runs] == [f"kvgate {p}" for p in POLICIES]
    assert 0.0 < data["oracle"] <= 1.0
    assert 0.0 < data["ttft_floor_p50_s"] <= data["ttft_floor_p99_s"]  # model figures
    sizes = {r["requests"] for r in runs}
    assert len(sizes) == 1 and sizes.pop() > 0  # same slice for every policy
    table = (tmp_path / "table.md").read_text()
    for run in runs:
        assert run["ok"] == run["requests"], run  # every request accounted for and answered
        assert 0.0 <= run["hit_rate"] <= 1.0
        assert run["ttft_p50_s"] > 0 and not math.isnan(run["ttft_p99_s"])
        assert run["label"] in table
        run_dir = tmp_path / run["label"].replace(" ", "_")
        records = read_records(run_dir / "records.jsonl")
        assert len(records) == run["requests"]
        queue = json.loads((run_dir / "router_metrics.json").read_text())
        assert queue["kvgate_queue_entered_total"] >= 0  # kvgate's queue, counted per run
        for rec in records:
            assert rec.status == "ok"
            assert rec.worker is not None
            assert 0 <= rec.cached_tokens <= rec.prompt_tokens == rec.expected_prompt_tokens
            assert rec.ttft_s is not None and rec.e2e_s is not None
            assert 0 < rec.ttft_s <= rec.e2e_s


@pytest.mark.slow
def test_quick_matrix_cell_runs_end_to_end(tmp_path: Path) -> None:
    """One matrix cell, kvgate policies only (no peer install): every run, the resume, the
    table, the JSON and the plot."""
    if not SHARED_TRACE.is_file():
        pytest.skip("../shared/traces is not beside the repo")
    argv = ["matrix", "--cells", "serial", "--duration", "6", "--repeats", "2",
            "--routers", "kv,least_loaded", "--out", str(tmp_path)]  # fmt: skip
    assert bench_main(argv) == 0
    data = json.loads((tmp_path / "matrix.json").read_text())
    (cell,) = data
    assert cell["cell"] == "serial" and cell["requests"] > 0
    for runs in cell["routers"].values():
        assert len(runs) == 2
        assert all(r["ok"] == r["requests"] == cell["requests"] for r in runs)
    assert (tmp_path / "matrix.png").stat().st_size > 0
    assert "serial FCFS prefill" in (tmp_path / "matrix.md").read_text()
    stamp = (tmp_path / "serial" / "r0" / "kvgate_kv" / "summary.json").stat().st_mtime_ns
    assert bench_main(argv) == 0  # everything on disk: nothing runs again
    assert (tmp_path / "serial" / "r0" / "kvgate_kv" / "summary.json").stat().st_mtime_ns == stamp
