"""bench/room_wait.py: room waits rebuilt from a run's client records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.bench import cli
from kvgate.bench.replay import request_id
from kvgate.bench.room_wait import Served, estimated_wait, read_served, residual_life, room_waits


def _record(index: int, worker: str, sent: float, ttft: float, e2e: float, prompt: int) -> dict:
    return {
        "index": index,
        "session_id": f"s{index}",
        "scheduled_s": sent,
        "expected_prompt_tokens": prompt,
        "max_tokens": 1,
        "sent_s": sent,
        "ttft_s": ttft,
        "e2e_s": e2e,
        "prompt_tokens": prompt,
        "cached_tokens": 0,
        "output_tokens": 0,
        "worker": worker,
        "status": "ok",
        "error": None,
    }


def _run(tmp_path: Path) -> Path:
    """Capacity 100 tokens. A holds 60 until t=11 (a long decode), B holds 60 until t=3; a
    50-token request sent to A at t=2 lacks room everywhere: 9 s at A, 1 s at B."""
    records = [
        _record(0, "A", 0.0, 0.1, 0.5, 10),  # ended: one decode of 0.4 s seen
        _record(1, "A", 1.0, 0.1, 10.0, 60),
        _record(2, "B", 1.0, 0.5, 2.0, 60),
        _record(3, "A", 2.0, 9.0, 9.5, 50),
        _record(4, "B", 30.0, 0.1, 0.2, 10),  # fits at once: not reported
        {**_record(5, "A", 2.5, 0.0, 0.0, 99), "status": "http_503", "ttft_s": None},
        {**_record(6, "A", 2.6, 0.1, 0.2, 98), "worker": None},  # no replica named
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_only_answered_requests_are_read(tmp_path: Path) -> None:
    served = read_served(_run(tmp_path))
    assert [s.prompt_tokens for s in served] == [10, 60, 60, 50, 10]


def test_room_waits_where_sent_by_hindsight_and_by_the_estimate(tmp_path: Path) -> None:
    (wait,) = room_waits(read_served(_run(tmp_path)), capacity=100)
    assert wait.prompt_tokens == 50
    assert wait.where_sent == pytest.approx(9.0)
    assert wait.hindsight == pytest.approx(1.0)
    assert wait.fits_nowhere
    # B's request has decoded 0.5 s, A's 0.9 s, both past the one decode seen (0.4 s): each
    # is expected to last as long again, so B is expected to free room first
    assert wait.residual_life == pytest.approx(1.0)


def test_a_request_queued_in_kvgate_holds_room_from_its_dispatch(tmp_path: Path) -> None:
    """kvgate's access log says the 50-token request waited 1 s in its queue: it reached A at
    t=3, when B's request had ended (room at B at once), and A's holds 60 until t=11."""
    run = _run(tmp_path)
    (run / "logs").mkdir()
    lines = [
        {"logger": "kvgate.access", "request_id": request_id(3), "queued_ms": 1000.0},
        {"logger": "kvgate.access", "request_id": request_id(1), "queued_ms": None},
    ]
    (run / "logs" / "kvgate-kv.log").write_text("".join(json.dumps(x) + "\n" for x in lines))
    served = read_served(run)
    assert [(s.prompt_tokens, s.sent) for s in served][3] == (50, pytest.approx(3.0))
    (wait,) = room_waits(served, capacity=100)
    assert wait.where_sent == pytest.approx(8.0)
    assert wait.hindsight == 0.0
    assert not wait.fits_nowhere


def test_residual_life_is_the_mean_remaining_of_longer_decodes() -> None:
    assert residual_life([1.0, 4.0, 6.0], 2.0) == pytest.approx(3.0)
    assert residual_life([1.0], 2.0) == pytest.approx(2.0)


def test_a_request_not_started_releases_nothing() -> None:
    queued = Served(sent=0.0, first=5.0, end=6.0, prompt_tokens=80, output_tokens=0, worker="A")
    assert estimated_wait([queued], 1.0, 50, 100, [0.5]) == float("inf")


def test_decoded_tokens_are_held_as_they_grow() -> None:
    s = Served(sent=0.0, first=1.0, end=3.0, prompt_tokens=10, output_tokens=20, worker="A")
    assert [s.held(t) for t in (0.5, 2.0, 3.0)] == [10.0, 20.0, 0.0]


def test_cli_reports_counts_and_summaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path)
    assert cli.main(["room-wait", str(run), "--capacity-blocks", "10", "--block-size", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"] == 1
    assert out["lacked_room_where_sent"] == 1
    assert out["fitting_nowhere"] == 1
    assert out["where_sent"]["max"] == pytest.approx(9.0)
    assert out["hindsight"]["max"] == pytest.approx(1.0)
