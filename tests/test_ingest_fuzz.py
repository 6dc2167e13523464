"""Fuzzing both event ingestion paths with hostile payloads (issue 12): tests/fuzz_ingest.py.

Seeded and time-bounded: ``KVGATE_FUZZ_SECONDS`` (default 20; keep CI at 60 or less) and
``KVGATE_FUZZ_SEED`` (default 1; set another to explore, the seed is in every failure). It runs
in a child process whose watchdog aborts it when one payload takes longer than the deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SECONDS = float(os.environ.get("KVGATE_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("KVGATE_FUZZ_SEED", "1"))
PAYLOAD_DEADLINE_S = 10.0  # a payload takes milliseconds; a hang is minutes or forever


@pytest.mark.slow
def test_hostile_payloads_neither_hang_nor_split_the_paths_nor_touch_other_workers() -> None:
    command = [
        sys.executable,
        str(HERE / "fuzz_ingest.py"),
        "--seed", str(SEED),
        "--seconds", str(SECONDS),
        "--deadline", str(PAYLOAD_DEADLINE_S),
    ]  # fmt: skip
    try:
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=SECONDS + 120, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fuzz run (seed {SEED}) did not end")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["payloads"] > 100, summary
    assert len(summary["kinds"]) >= 10, summary  # every kind of payload was tried
