"""The event-storm benchmark, small (bench/storm.py): kvgate routes a steady request stream while
an extra publisher floods it with valid, malformed and adversarial payloads (issue 12).

Asserts what must hold whatever the machine: every request answered, the honest workers'
predictions exact during and after the storm, the storm's payloads refused and counted,
kvgate's memory within its configured bounds. Latency is measured by the benchmark itself
(docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.bench.storm import main as storm_main
from kvgate.index.config import IndexConfig

MAX_ENTRIES = 50_000  # the benchmark's --index-max-entries
# what kvgate may hold beyond its start: both sockets of the hostile worker full, plus the
# index at its cap (about 300 bytes an entry); far above what a run uses
CONFIG = IndexConfig()
RSS_GROWTH_CAP_MB = (2 * CONFIG.receive_hwm * CONFIG.max_message_bytes + 300 * MAX_ENTRIES) / 2**20


@pytest.mark.slow
def test_a_storm_costs_the_other_workers_nothing(tmp_path: Path) -> None:
    out = tmp_path / "storm.json"
    argv = ["--replicas", "1", "--seconds", "5", "--rate", "3", "--json", str(out)]
    argv += ["--max-entries", str(MAX_ENTRIES)]
    assert storm_main(argv) == 0
    quiet, storm = json.loads(out.read_text())
    assert storm["storm_sent"] > 1000
    for run in (quiet, storm):
        assert run["failed_requests"] == 0, run
        for phase in ("accuracy_during", "accuracy_after"):
            accuracy = run[phase]
            assert accuracy["requests"] > 0, (run["mode"], phase)
            assert accuracy["exact"] == accuracy["requests"], (run["mode"], phase, accuracy)
        assert run["rss_peak_mb"] - run["rss_start_mb"] < RSS_GROWTH_CAP_MB
    counters = storm["counters"]
    refused = counters.get("kvgate_index_decode_errors_total", 0) + counters.get(
        "kvgate_index_limits_total", 0
    )
    assert refused > 100, counters  # refused and counted, one by one: its subscriber lives
    assert counters.get("kvgate_index_subscriber_restarts_total", 0) == 0, counters
