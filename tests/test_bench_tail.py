"""bench/tail.py: the causes of a run's slowest requests, from client records and kvgate's
access log joined on the replayer's ``x-request-id``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.bench import cli
from kvgate.bench.replay import request_id
from kvgate.bench.tail import (
    FIRST_TURN,
    HISTORY_KEPT,
    HISTORY_LOST,
    LOST_AFTER,
    LOST_BEFORE,
    MOVED,
    cause_of,
    classify,
    read_access,
    slowest,
)


def _record(index: int, session: str, sent: float, ttft: float, prompt: int, cached: int) -> dict:
    return {
        "index": index,
        "session_id": session,
        "scheduled_s": sent,
        "expected_prompt_tokens": prompt,
        "max_tokens": 1,
        "sent_s": sent,
        "ttft_s": ttft,
        "e2e_s": ttft + 0.1,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": 1,
        "worker": "http://127.0.0.1:1",
        "status": "ok",
        "error": None,
    }


def _access(index: int, best: int, predicted: int, queued_ms: float | None = None) -> str:
    line: dict[str, Any] = {
        "time": "2026-12-06T07:00:00.000Z",
        "level": "info",
        "logger": "kvgate.access",
        "message": "request",
        "request_id": f"replay-{index}",
        "best_cached_tokens": best,
        "predicted_cached_tokens": predicted,
        "queued_ms": queued_ms,
    }
    return json.dumps(line)


def test_the_replayer_names_each_request_by_its_trace_index() -> None:
    assert request_id(7) == "replay-7"


@pytest.mark.parametrize(
    ("cached", "history", "access", "cause"),
    [
        (0, 0, None, FIRST_TURN),  # no earlier turn
        (600, 1000, None, HISTORY_KEPT),  # at least half of its history cached
        (100, 1000, None, HISTORY_LOST),  # lost, and no access log to say why
        (100, 1000, {"best_cached_tokens": 200, "predicted_cached_tokens": 200}, LOST_BEFORE),
        (100, 1000, {"best_cached_tokens": 900, "predicted_cached_tokens": 0}, MOVED),
        (100, 1000, {"best_cached_tokens": 900, "predicted_cached_tokens": 900}, LOST_AFTER),
    ],
)
def test_each_cause(cached: int, history: int, access: dict[str, int] | None, cause: str) -> None:
    assert cause_of(2000, cached, history, access)[0] == cause


def test_a_run_is_read_and_classified_slowest_first(tmp_path: Path) -> None:
    records = [
        _record(0, "a", 0.0, 0.2, 1000, 0),  # a's first turn
        _record(1, "b", 0.5, 0.1, 800, 0),  # b's first turn
        _record(2, "a", 1.0, 3.0, 1200, 0),  # a's history (1000) lost: moved
        _record(3, "b", 1.5, 0.5, 900, 800),  # b's history kept
        _record(4, "b", 2.0, 2.0, 1000, 100),  # lost before routing
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [
        '{"logger": "kvgate", "message": "started"}',
        "not json at all, kvgate.access",
        _access(2, best=992, predicted=0, queued_ms=250.0),
        _access(3, best=800, predicted=800),
        _access(4, best=0, predicted=0),
    ]
    (logs / "kvgate-kv.log").write_text("\n".join(lines) + "\n")

    served = classify(records, read_access(tmp_path))
    assert [(s.index, s.cause) for s in served] == [
        (2, MOVED),
        (4, LOST_BEFORE),
        (3, HISTORY_KEPT),
        (0, FIRST_TURN),
        (1, FIRST_TURN),
    ]
    assert served[0].history_tokens == 1000
    assert served[0].queued_ms == 250.0
    assert served[-1].best_cached_tokens is None  # no access line for it
    assert [s.index for s in slowest(served, 0.4)] == [2, 4]
    assert [s.index for s in slowest(served, 0.01)] == [2]  # at least one


def test_cli_reports_causes_per_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "x1.5-run1" / "kvgate_kv"
    run.mkdir(parents=True)
    records = [_record(0, "a", 0.0, 0.2, 1000, 0), _record(1, "a", 1.0, 3.0, 1200, 0)]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["tail", str(run), "--share", "0.5", "--top", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    entry = out["kvgate_kv"]
    assert entry["runs"] == 1 and entry["slowest"] == 1
    assert entry["causes"] == {
        HISTORY_LOST: {"requests": 1, "mean_ttft_s": 3.0, "mean_uncached_tokens": 1200}
    }
    assert entry["top"][0][0]["index"] == 1
    assert cli.main(["tail", str(tmp_path), "--top", "0"]) == 0  # the run found below it
    assert json.loads(capsys.readouterr().out)["kvgate_kv"]["runs"] == 1
    with pytest.raises(SystemExit):
        cli.main(["tail", str(run), "--share", "0"])
    with pytest.raises(SystemExit):
        cli.main(["tail", str(run / "records.jsonl")])  # a file, not a run directory
