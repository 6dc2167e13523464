"""The overload ramp: the same routers side by side at session rates from below to above the
fleet's saturating rate, each point repeated, summarised as served-TTFT percentiles, goodput
(answered requests whose TTFT is within an SLO, per second), rejections and hit rate.

Goodput is given two ways. Every router is sent the same requests (the slice is fixed and the
turns of a session wait for each other), so answering all of them within the SLO, per second
of the whole replay, is the request count over the replay's length: when the last session's
last answer ended, which one chain of turns decides (one router's replay lasted 98.7 s in one
repeat and 111.9 s in another). The load window's goodput counts the requests that had their
first token, within the SLO, before the slice's duration (``--duration``) ended, per second of
it: how much good work each router got done while the load was offered, a figure that one
late session does not move.

Each (point, repeat) is one ``bench.compare`` run (every router on a cold fleet, the same
slice); the ramp table gives, per point and router, the median over repeats of each figure
and the range of p99 and goodput, and the p99 and mean of every served request of every
repeat pooled. One run's p99 is its few slowest requests (the 4th slowest of 316), and it
moves up to 2x between runs of one router; the pooled p99 (of 3 x 316) moves less.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvgate.bench.compare import CompareConfig, RouterRun, RunOutput, compare
from kvgate.bench.replay import RequestRecord
from kvgate.bench.report import percentile, window_counts
from kvgate.bench.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class PointResult:
    """One router at one load point in one repeat."""

    factor: float  # session rate / saturating session rate
    session_rate: float
    repeat: int
    router: str
    sent: int
    ok: int
    rejected_429: int
    rejected_503: int
    other_failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    goodput_rps: float
    hit_rate: float
    wall_s: float
    queued: int  # requests that waited in kvgate's queue (0 for peers)
    served_ttft_s: tuple[float, ...] = ()  # every served request's TTFT, to pool repeats
    window_goodput_rps: float | None = None  # None: the replay had no duration


def served_ttfts(records: Sequence[RequestRecord]) -> tuple[float, ...]:
    """The TTFT of every answered request (with a first token)."""
    return tuple(r.ttft_s for r in records if r.status == "ok" and r.ttft_s is not None)


def goodput(served: Sequence[float], slo_s: float, wall_s: float) -> float:
    """Answered requests (their TTFTs, ``served_ttfts``) whose TTFT is within ``slo_s``, per
    second of the replay."""
    good = sum(1 for ttft in served if ttft <= slo_s)
    return good / wall_s if wall_s > 0 else 0.0


def window_goodput(records: Sequence[RequestRecord], slo_s: float, window_s: float) -> float:
    """Answered requests whose first token came within ``slo_s`` of their sending and before
    ``window_s`` seconds of the replay, per second of ``window_s``."""
    _answered, good = window_counts(records, window_s, slo_s)
    return good / window_s if window_s > 0 else 0.0


def point_result(
    output: RunOutput,
    *,
    factor: float,
    rate: float,
    repeat: int,
    slo_s: float,
    window_s: float | None = None,
) -> PointResult:
    records = output.result.records
    summary = output.summary
    statuses = [r.status for r in records]
    rejected_429 = statuses.count("http_429")
    rejected_503 = statuses.count("http_503")
    served = served_ttfts(records)
    return PointResult(
        factor=factor,
        session_rate=rate,
        repeat=repeat,
        router=summary.label,
        sent=len(records),
        ok=summary.ok,
        rejected_429=rejected_429,
        rejected_503=rejected_503,
        other_failed=len(records) - summary.ok - rejected_429 - rejected_503,
        ttft_p50_s=summary.ttft_p50_s,
        ttft_p99_s=summary.ttft_p99_s,
        goodput_rps=goodput(served, slo_s, output.result.wall_s),
        hit_rate=summary.hit_rate,
        wall_s=output.result.wall_s,
        queued=round(output.router_metrics.get("kvgate_queue_entered_total", 0.0)),
        served_ttft_s=served,
        window_goodput_rps=None if window_s is None else window_goodput(records, slo_s, window_s),
    )


def run_point(
    runs: Sequence[RouterRun],
    requests: Sequence[TraceRequest],
    cfg: CompareConfig,
    *,
    factor: float,
    rate: float,
    repeat: int,
    slo_s: float,
) -> list[PointResult]:
    outputs = compare(runs, requests, cfg)
    window = cfg.replay.max_duration_s
    return [
        point_result(o, factor=factor, rate=rate, repeat=repeat, slo_s=slo_s, window_s=window)
        for o in outputs
    ]


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def _window_goodput(group: Sequence[PointResult]) -> str:
    values = [r.window_goodput_rps for r in group if r.window_goodput_rps is not None]
    return f"{statistics.median(values):.2f} ({_span(values)})" if values else "–"


def ramp_table(results: Sequence[PointResult], slo_s: float) -> str:
    """Markdown: one row per (point, router), medians over repeats (ranges for p99, goodput),
    the p99 and mean TTFT of the repeats' served requests pooled, and the requests answered,
    sent and rejected summed over the repeats (a median would hide a run that lost some)."""
    lines = [
        f"| load (× saturation) | router | runs | ok/sent, all runs | 429 | 503 | TTFT p50 (s) | "
        f"TTFT p99 (s), median (range) | TTFT p99, pooled (s) | TTFT mean, pooled (s) | "
        f"goodput ≤{slo_s:g} s (req/s), median (range) | "
        f"goodput ≤{slo_s:g} s in the load window (req/s), median (range) | hit rate | queued |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys: list[tuple[float, str]] = []
    for r in results:
        if (r.factor, r.router) not in keys:
            keys.append((r.factor, r.router))
    for factor, router in keys:
        group = [r for r in results if r.factor == factor and r.router == router]
        p99 = [r.ttft_p99_s for r in group]
        good = [r.goodput_rps for r in group]
        pooled = [t for r in group for t in r.served_ttft_s]
        mean = statistics.fmean(pooled) if pooled else float("nan")

        def med(values: Sequence[float]) -> float:
            return statistics.median(values)

        lines.append(
            f"| {factor:g} | {router} | {len(group)} | "
            f"{sum(r.ok for r in group)}/{sum(r.sent for r in group)} | "
            f"{sum(r.rejected_429 for r in group)} | {sum(r.rejected_503 for r in group)} | "
            f"{med([r.ttft_p50_s for r in group]):.3f} | {med(p99):.2f} ({_span(p99)}) | "
            f"{percentile(pooled, 99):.2f} | {mean:.3f} | "
            f"{med(good):.2f} ({_span(good)}) | {_window_goodput(group)} | "
            f"{med([r.hit_rate for r in group]):.3f} | "
            f"{med([r.queued for r in group]):.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_ramp(results: Sequence[PointResult], out: Path, slo_s: float, title: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = f"## {title}\n\n{ramp_table(results, slo_s)}"
    (out / "ramp.md").write_text(text)
    (out / "ramp.json").write_text(
        json.dumps([asdict(r) for r in results], indent=2, default=str) + "\n"
    )
    return text
