"""Why the slowest requests of finished runs were slow: ``kvgate bench tail RUN_DIR...``.

It reads each run directory's client records (``records.jsonl``, as ``bench replay``,
``compare`` and ``overload`` write them) and, where the router was kvgate logging at info in
JSON (``--serve-arg=--log-level=info --serve-arg=--log-format=json``), kvgate's access log
in ``logs/kvgate-*.log``, joined on the ``x-request-id`` the replayer sends
(``replay-<index>``). Each answered request gets one cause, the first that applies:

* ``first turn``: no earlier request of its session in the run (its prompt is new to the
  fleet, but for a prefix shared with other sessions);
* ``history kept``: the engine reported at least half of its *history* cached (the prompt of
  the session's previous request, capped at its own), so its time went to waiting (kvgate's
  queue, the engine's) and the rest of its prefill;
* ``history lost``: the engine reported less than half of it. With kvgate's access log this
  is split by what kvgate knew when it routed the request:

  * ``lost before routing``: no replica held half of it in kvgate's index
    (``best_cached_tokens``): the fleet evicted it between turns;
  * ``moved off its cache``: some replica held it, and kvgate sent the request elsewhere
    (``predicted_cached_tokens`` under half of the best) for room or for balance;
  * ``lost after routing``: kvgate predicted it cached where it sent it, and the engine
    evicted it before the request ran.

Per router (a run directory's last component), the report counts the causes among the
slowest ``--share`` of each run's requests (default the slowest 5%) and lists the slowest
``--top`` of every run with their figures, so a tail can be read rather than guessed at.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.bench.replay import request_id

FIRST_TURN = "first turn"
HISTORY_KEPT = "history kept"
HISTORY_LOST = "history lost"
LOST_BEFORE = "lost before routing"
MOVED = "moved off its cache"
LOST_AFTER = "lost after routing"
CAUSES = (FIRST_TURN, HISTORY_KEPT, HISTORY_LOST, LOST_BEFORE, MOVED, LOST_AFTER)
MAX_LINE_BYTES = 65_536  # an access-log line longer than this is not one kvgate wrote


@dataclass(frozen=True, slots=True)
class Slow:
    """One answered request and the cause given to it."""

    index: int
    session: str | None
    sent_s: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    history_tokens: int  # the session's previous prompt, capped at this one (0: first turn)
    worker: str | None
    cause: str
    best_cached_tokens: int | None = None  # kvgate's access log, when read
    predicted_cached_tokens: int | None = None
    queued_ms: float | None = None


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    with (run_dir / "records.jsonl").open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def read_access(run_dir: Path) -> dict[str, dict[str, Any]]:
    """kvgate's access-log lines of the run (JSON format), by request id; {} without any."""
    lines: dict[str, dict[str, Any]] = {}
    for path in sorted((run_dir / "logs").glob("kvgate-*.log")):
        with path.open("rb") as fh:
            for raw in fh:
                if len(raw) > MAX_LINE_BYTES or b'"kvgate.access"' not in raw:
                    continue
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # a text-format log, or a torn line
                if isinstance(line, dict) and isinstance(line.get("request_id"), str):
                    lines[line["request_id"]] = line
    return lines


def cause_of(
    prompt: int, cached: int, history: int, access: Mapping[str, Any] | None
) -> tuple[str, int | None, int | None]:
    """The cause (see the module's doc), with kvgate's best and predicted cached tokens."""
    best = _int_or_none(access, "best_cached_tokens")
    predicted = _int_or_none(access, "predicted_cached_tokens")
    if history <= 0:
        return FIRST_TURN, best, predicted
    if 2 * cached >= history:
        return HISTORY_KEPT, best, predicted
    if best is None or predicted is None:
        return HISTORY_LOST, best, predicted
    if 2 * best < history:
        return LOST_BEFORE, best, predicted
    if 2 * predicted < best:
        return MOVED, best, predicted
    return LOST_AFTER, best, predicted


def queued_ms_of(access: Mapping[str, Any] | None) -> float | None:
    """The access-log line's ``queued_ms`` (None: no line, or the request never queued)."""
    queued = None if access is None else access.get("queued_ms")
    return float(queued) if isinstance(queued, int | float) else None


def _int_or_none(access: Mapping[str, Any] | None, key: str) -> int | None:
    value = None if access is None else access.get(key)
    return value if isinstance(value, int) else None


def classify(
    records: Sequence[Mapping[str, Any]], access: Mapping[str, Mapping[str, Any]]
) -> list[Slow]:
    """Every answered request of one run with its cause, slowest first."""
    previous: dict[str, int] = {}  # session -> prompt tokens of its latest request sent
    out = []
    for r in sorted(records, key=lambda r: (r.get("sent_s") is None, r.get("sent_s") or 0.0)):
        session = r.get("session_id")
        prompt = int(r.get("prompt_tokens") or 0)
        history = min(previous.get(session, 0), prompt) if session is not None else 0
        if session is not None and r.get("sent_s") is not None:
            previous[session] = max(prompt, int(r.get("expected_prompt_tokens") or 0))
        if r.get("status") != "ok" or r.get("ttft_s") is None:
            continue
        line = access.get(request_id(int(r["index"])))
        cached = int(r.get("cached_tokens") or 0)
        cause, best, predicted = cause_of(prompt, cached, history, line)
        out.append(
            Slow(
                index=int(r["index"]),
                session=session,
                sent_s=float(r["sent_s"]),
                ttft_s=float(r["ttft_s"]),
                prompt_tokens=prompt,
                cached_tokens=cached,
                history_tokens=history,
                worker=r.get("worker"),
                cause=cause,
                best_cached_tokens=best,
                predicted_cached_tokens=predicted,
                queued_ms=queued_ms_of(line),
            )
        )
    return sorted(out, key=lambda s: -s.ttft_s)


def slowest(served: Sequence[Slow], share: float) -> list[Slow]:
    """The slowest ``share`` of a run's answered requests (at least one), slowest first."""
    if not served:
        return []
    return list(served[: max(1, round(share * len(served)))])


def run_dirs(paths: Iterable[Path]) -> list[Path]:
    """Each path that holds ``records.jsonl``, else the run directories under it (a ramp's
    or a comparison's output); ``SystemExit`` for a path with none."""
    found: list[Path] = []
    for path in paths:
        if (path / "records.jsonl").is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.rglob("records.jsonl")) if path.is_dir() else []
        if not below:
            raise SystemExit(f"{path}: no records.jsonl in or under it")
        found += below
    return found


def router_of(run_dir: Path) -> str:
    return run_dir.name


def report(runs: Iterable[tuple[str, Sequence[Slow]]], share: float, top: int) -> dict[str, Any]:
    """Per router: runs read, requests in the slowest share, their causes, their mean TTFT
    and uncached tokens by cause; and each run's ``top`` slowest requests."""
    runs_of: Counter[str] = Counter()
    tails: dict[str, list[Slow]] = {}
    tops: dict[str, list[list[dict[str, Any]]]] = {}
    for name, served in runs:
        runs_of[name] += 1
        tails.setdefault(name, []).extend(slowest(served, share))
        tops.setdefault(name, []).append([_row(s) for s in served[:top]])
    routers: dict[str, dict[str, Any]] = {}
    for name, tail in tails.items():
        entry: dict[str, Any] = {"runs": runs_of[name], "slowest": len(tail), "causes": {}}
        for cause in CAUSES:
            group = [s for s in tail if s.cause == cause]
            if group:
                entry["causes"][cause] = {
                    "requests": len(group),
                    "mean_ttft_s": round(sum(s.ttft_s for s in group) / len(group), 3),
                    "mean_uncached_tokens": round(
                        sum(s.prompt_tokens - s.cached_tokens for s in group) / len(group)
                    ),
                }
        if top > 0:
            entry["top"] = tops[name]
        routers[name] = entry
    return routers


def _row(s: Slow) -> dict[str, Any]:
    row = {
        "index": s.index,
        "session": s.session,
        "sent_s": round(s.sent_s, 2),
        "ttft_s": round(s.ttft_s, 3),
        "prompt": s.prompt_tokens,
        "cached": s.cached_tokens,
        "history": s.history_tokens,
        "worker": s.worker,
        "cause": s.cause,
    }
    if s.best_cached_tokens is not None:
        row |= {
            "best": s.best_cached_tokens,
            "predicted": s.predicted_cached_tokens,
            "queued_ms": s.queued_ms,
        }
    return row


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "runs", nargs="+", type=Path, help="run directories (records.jsonl), or folders of them"
    )
    p.add_argument(
        "--share", type=float, default=0.05, help="the slowest share of each run to count"
    )
    p.add_argument("--top", type=int, default=5, help="slowest requests listed per run")


def main(args: argparse.Namespace) -> int:
    if not 0 < args.share <= 1:
        raise SystemExit("--share must be in (0, 1]")
    dirs = run_dirs(args.runs)
    runs = [(router_of(d), classify(read_records(d), read_access(d))) for d in dirs]
    print(json.dumps(report(runs, args.share, max(0, args.top)), indent=2))
    return 0
