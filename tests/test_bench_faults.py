"""The fault benchmark, short and seeded (bench/faults.py): through a replica crash with
requests queued, aborts and resets before the first token, a 5xx burst and a replica whose
event stream stops, no request fails before its first token and kvgate's predictions stay
honest (phantom share at most 0.5%).

Only the two zero-aims are asserted; times (TTFT, recovery) are the benchmark's to measure
(docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.faults import main as faults_main

SCENARIOS = ("crash", "abort", "http_5xx", "stop_events")


@pytest.mark.slow
def test_no_request_fails_before_its_first_token_and_no_phantom_hits(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    argv = ["--scenarios", ",".join(SCENARIOS), "--runs", "1", "--seconds", "9"]
    argv += ["--fault-at", "3", "--drain", "15", "--slots", "12", "--capacity-blocks", "400"]
    argv += ["--seed", "14", "--json", str(out), "--out", str(tmp_path / "logs")]
    assert faults_main(argv) == 0
    results = {r["scenario"]: r for r in json.loads(out.read_text())}
    assert set(results) == set(SCENARIOS)
    for name, result in results.items():
        assert result["sent"] > 20, name
        assert result["failed_before_token"] == 0, (name, result["failures"])
        assert result["predicted_tokens"] > 0, name
        assert result["phantom_share"] <= 0.005, (name, result["phantom_tokens"])
        applied = [step for step in result["steps"] if "skipped" not in step]
        assert applied and all(step["result"] == "ok" for step in applied), result["steps"]
    # the faults were felt: the crashed replica was resynced, kvgate retried
    assert results["crash"]["counters"].get("kvgate_index_resyncs_total{worker_down}", 0) > 0
    assert results["abort"]["kvgate_retries"] > 0
    assert results["http_5xx"]["counters"].get("kvgate_upstream_retries_total{http_5xx}", 0) > 0
