"""Summaries of replay runs: metrics, markdown tables and matplotlib PNGs."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvgate.bench.replay import MetricsSample, RequestRecord

BUSY_METRIC = "kvgate_sim_busy_seconds_total"
LATE_METRIC = "kvgate_sim_late_seconds_total"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(slots=True)
class CpuUse:
    """CPU seconds per process over one replay, and the whole box's busy share."""

    wall_s: float
    seconds: dict[str, float] = field(default_factory=dict)  # process label -> cpu seconds
    box_busy_s: float = 0.0  # all processes on the machine, all cores
    cores: int = 2

    @property
    def box_utilisation(self) -> float:
        return self.box_busy_s / (self.wall_s * self.cores) if self.wall_s else 0.0


@dataclass(slots=True)
class RunSummary:
    label: str
    requests: int
    ok: int
    failed: int
    cancelled: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    hit_vs_oracle: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    throughput_rps: float
    throughput_tok_s: float
    busy_s: dict[str, float]
    busy_source: str
    imbalance: float
    fleet_busy: float  # mean busy share of the replicas over the run
    per_worker_requests: dict[str, int]
    wall_s: float
    cpu: dict[str, float]  # label -> cores used on average
    box_utilisation: float
    fleet_late: float = math.nan
    """The replicas' mean share of the run their steps began late (NaN: not exported)."""
    window_s: float = math.nan
    """The load window: the slice's duration (``--duration``; NaN: none)."""
    answered_in_window: int = 0
    """Requests whose first token came before the load window ended."""
    window_goodput_rps: float = math.nan
    """Those of them whose TTFT was within ``slo_s``, per second of the window."""
    slo_s: float = math.nan


def window_counts(
    records: Sequence[RequestRecord], window_s: float, slo_s: float
) -> tuple[int, int]:
    """(answered, answered within ``slo_s``): requests whose first token came within
    ``window_s`` seconds of the replay's start."""
    answered = good = 0
    for r in records:
        if r.status != "ok" or r.ttft_s is None or r.sent_s is None:
            continue
        if r.sent_s + r.ttft_s <= window_s:
            answered += 1
            good += r.ttft_s <= slo_s
    return answered, good


def busy_from_records(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Per worker: time with at least one of its requests in flight (union of intervals)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r.worker is None or r.sent_s is None or r.e2e_s is None:
            continue
        spans.setdefault(r.worker, []).append((r.sent_s, r.sent_s + r.e2e_s))
    out: dict[str, float] = {}
    for worker, ivs in spans.items():
        ivs.sort()
        total = 0.0
        cur_start, cur_end = ivs[0]
        for start, end in ivs[1:]:
            if start > cur_end:
                total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        out[worker] = total + cur_end - cur_start
    return out


def counter_growth(
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    metric: str,
) -> dict[str, float] | None:
    """Per replica: growth of the counter ``metric`` over the run (None if not exported)."""
    out: dict[str, float] = {}
    for url, values in after.items():
        if metric not in values:
            return None
        out[url] = values[metric] - before.get(url, {}).get(metric, 0.0)
    return out or None


def busy_from_metrics(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, float] | None:
    """Per replica: growth of the simulator's busy-seconds counter (None if not exported)."""
    return counter_growth(before, after, BUSY_METRIC)


def busy_from_samples(samples: Sequence[MetricsSample]) -> dict[str, float] | None:
    """Per replica: time between consecutive /metrics samples where it had work
    (running + waiting > 0 at the earlier sample). Approximate, but the same for every router."""
    by_replica: dict[str, list[MetricsSample]] = {}
    for s in samples:
        by_replica.setdefault(s.replica, []).append(s)
    out: dict[str, float] = {}
    for replica, series in by_replica.items():
        series.sort(key=lambda s: s.t)
        total = 0.0
        for a, b in itertools.pairwise(series):
            load = a.values.get("vllm:num_requests_running", 0.0) + a.values.get(
                "vllm:num_requests_waiting", 0.0
            )
            if load > 0:
                total += b.t - a.t
        out[replica] = total
    return out or None


def imbalance(busy: Mapping[str, float], replicas: int) -> float:
    """max ÷ mean busy time over all replicas (idle replicas count as 0)."""
    values = list(busy.values()) + [0.0] * max(0, replicas - len(busy))
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else math.nan


def _per_worker_requests(
    ok: Sequence[RequestRecord],
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
) -> dict[str, int]:
    """Requests served per replica: from the chosen-worker header when the router names it,
    else from each replica's ``vllm:request_success_total`` growth."""
    per_worker: dict[str, int] = {}
    for r in ok:
        if r.worker is not None:
            per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    if per_worker or not after:
        return per_worker
    name = "vllm:request_success_total"
    return {
        url.removesuffix("/metrics"): round(v.get(name, 0.0) - before.get(url, {}).get(name, 0.0))
        for url, v in after.items()
    }


def _busy(
    records: Sequence[RequestRecord],
    before: Mapping[str, Mapping[str, float]] | None,
    after: Mapping[str, Mapping[str, float]] | None,
    samples: Sequence[MetricsSample],
) -> tuple[dict[str, float], str]:
    """Busy seconds per replica, from the best source available."""
    busy = busy_from_metrics(before or {}, after or {})
    if busy is not None:  # modelled engine step time, already in wall seconds
        return busy, "sim busy counter"
    busy = busy_from_samples(samples)
    if busy is not None:
        return busy, "metrics samples"
    return busy_from_records(records), "client-side spans"


def _late_share(
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    wall_s: float,
) -> float:
    """The time the simulated replicas lost to their model (behind it past what they make
    up), as a share of the run (mean over replicas; NaN when the fleet does not export it):
    a simulator behind its model serves slower than the model, and a comparison then
    measures that as well."""
    late = counter_growth(before, after, LATE_METRIC)
    if not late or not wall_s:
        return math.nan
    return sum(late.values()) / len(late) / wall_s


def summarize(
    label: str,
    records: Sequence[RequestRecord],
    *,
    oracle_hit_rate: float,
    wall_s: float,
    replicas: int,
    cpu: CpuUse | None = None,
    metrics_before: Mapping[str, Mapping[str, float]] | None = None,
    metrics_after: Mapping[str, Mapping[str, float]] | None = None,
    samples: Sequence[MetricsSample] = (),
    window_s: float | None = None,
    slo_s: float = math.nan,
) -> RunSummary:
    ok = [r for r in records if r.status == "ok"]
    answered, good = window_counts(records, window_s, slo_s) if window_s else (0, 0)
    prompt = sum(r.prompt_tokens or r.expected_prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    hit = cached / prompt if prompt else 0.0
    busy, source = _busy(records, metrics_before, metrics_after, samples)
    per_worker = _per_worker_requests(ok, metrics_before or {}, metrics_after or {})
    total_tokens = sum(r.prompt_tokens + r.output_tokens for r in ok)
    mean_busy = sum(busy.values()) / replicas if replicas else 0.0
    return RunSummary(
        label=label,
        requests=len(records),
        ok=len(ok),
        failed=sum(1 for r in records if r.status not in {"ok", "cancelled"}),
        cancelled=sum(1 for r in records if r.status == "cancelled"),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=hit,
        hit_vs_oracle=hit / oracle_hit_rate if oracle_hit_rate else math.nan,
        ttft_p50_s=percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        ttft_p99_s=percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
        e2e_p50_s=percentile([r.e2e_s for r in ok if r.e2e_s is not None], 50),
        throughput_rps=len(ok) / wall_s if wall_s else 0.0,
        throughput_tok_s=total_tokens / wall_s if wall_s else 0.0,
        busy_s=busy,
        busy_source=source,
        imbalance=imbalance(busy, replicas),
        fleet_busy=mean_busy / wall_s if wall_s else 0.0,
        fleet_late=_late_share(metrics_before or {}, metrics_after or {}, wall_s),
        per_worker_requests=per_worker,
        wall_s=wall_s,
        cpu={k: (v / cpu.wall_s if cpu.wall_s else 0.0) for k, v in cpu.seconds.items()}
        if cpu
        else {},
        box_utilisation=cpu.box_utilisation if cpu else math.nan,
        window_s=window_s or math.nan,
        answered_in_window=answered,
        window_goodput_rps=good / window_s if window_s else math.nan,
        slo_s=slo_s,
    )


def run_dir_name(label: str) -> str:
    """The folder of a router's run in a comparison's output (its label, no spaces or
    slashes)."""
    return label.replace(" ", "_").replace("/", "_")


def write_summary(path: Path, summary: RunSummary) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(summary), indent=2, default=str) + "\n")


def read_summary(path: Path) -> RunSummary:
    """A summary ``write_summary`` wrote (the matrix resumes from them)."""
    return RunSummary(**json.loads(path.read_text()))


def _fmt(x: float, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


@dataclass(frozen=True, slots=True)
class References:
    """The rows every router is read against, computed from the trace slice alone.

    ``oracle_hit_rate``: one infinite cache. ``ttft_floor``: per request, its TTFT alone on
    an idle simulated replica holding the oracle's cache. ``pooled_hit_rate``: one LRU cache
    of the fleet's total capacity (``pooled_capacity_tokens``), what eviction leaves
    reachable (a reference, not a bound).
    """

    oracle_hit_rate: float
    ttft_floor: Sequence[float] = ()
    pooled_hit_rate: float | None = None
    pooled_capacity_tokens: int | None = None
    floor_source: str = "model"
    """How ``ttft_floor`` was had: ``model`` (the simulator's timing, computed) or
    ``measured`` (each request alone on an idle replica of the engine, its oracle prefix
    cached first: bench/floor.py)."""

    def as_json(self) -> dict[str, float | int | str | None]:
        return {
            "oracle": self.oracle_hit_rate,
            "ttft_floor_p50_s": percentile(self.ttft_floor, 50),
            "ttft_floor_p99_s": percentile(self.ttft_floor, 99),
            "pooled_lru_hit_rate": self.pooled_hit_rate,
            "pooled_lru_capacity_tokens": self.pooled_capacity_tokens,
            "ttft_floor_source": self.floor_source,
        }


def markdown_table(summaries: Sequence[RunSummary], refs: References) -> str:
    """One row per router, then the reference rows: the oracle (with the TTFT floor's p50
    and p99 when known) and the pooled LRU cache (when the fleet's capacity is known)."""
    head = (
        "| router | ok/sent | hit rate | ÷ oracle | TTFT p50 (s) | TTFT p99 (s) | e2e p50 (s) "
        "| req/s | imbalance | fleet busy | CPU (cores: router / fleet / replayer) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        cpu = " / ".join(_fmt(s.cpu.get(k, math.nan), 2) for k in ("router", "fleet", "replayer"))
        rows.append(
            f"| {s.label} | {s.ok}/{s.requests} | {_fmt(s.hit_rate)} | {_fmt(s.hit_vs_oracle, 2)} "
            f"| {_fmt(s.ttft_p50_s)} | {_fmt(s.ttft_p99_s)} | {_fmt(s.e2e_p50_s)} "
            f"| {_fmt(s.throughput_rps, 2)} | {_fmt(s.imbalance, 2)} | {_fmt(s.fleet_busy, 2)} "
            f"| {cpu} (box {_fmt(s.box_utilisation, 2)}) |"
        )
    floor = refs.ttft_floor
    p50, p99 = _fmt(percentile(floor, 50)), _fmt(percentile(floor, 99))  # a dash when empty
    idle = "; TTFT: alone on an idle replica" if floor else ""
    oracle = refs.oracle_hit_rate
    rows.append(
        f"| oracle (one infinite cache{idle}) | – | {_fmt(oracle)} | 1.00 | {p50} | {p99} "
        "| – | – | – | – | – |"
    )
    if refs.pooled_hit_rate is not None:
        pooled = refs.pooled_hit_rate
        ratio = _fmt(pooled / oracle, 2) if oracle else "–"
        size = f"{refs.pooled_capacity_tokens:,} tokens" if refs.pooled_capacity_tokens else ""
        rows.append(
            f"| pooled LRU (one cache of the fleet's capacity{', ' + size if size else ''}) "
            f"| – | {_fmt(pooled)} | {ratio} | – | – | – | – | – | – | – |"
        )
    return head + "\n".join(rows) + "\n"


def saturation_warning(summaries: Sequence[RunSummary], limit: float = 0.85) -> str | None:
    """A warning when the box was near saturation during any run."""
    hot = [s for s in summaries if not math.isnan(s.box_utilisation) and s.box_utilisation > limit]
    if not hot:
        return None
    worst = max(hot, key=lambda s: s.box_utilisation)
    return (
        f"WARNING: the machine was {worst.box_utilisation:.0%} busy during '{worst.label}' "
        f"(limit {limit:.0%}): results measure the box, not the router. Lower --speedup."
    )


# --- plots --------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415  (lazy: keeps `kvgate bench --help` fast)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot_ttft_cdf(runs: Mapping[str, Sequence[RequestRecord]], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for label, records in runs.items():
        values = sorted(r.ttft_s for r in records if r.status == "ok" and r.ttft_s is not None)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.plot(values, ys, label=label, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log)")
    ax.set_ylabel("share of requests")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_hit_rates(
    summaries: Sequence[RunSummary], oracle_hit_rate: float, path: Path, title: str
) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    labels = [s.label for s in summaries]
    ax.barh(labels, [s.hit_rate for s in summaries], color="#4c72b0")
    ax.axvline(oracle_hit_rate, color="#c44e52", linestyle="--", label="oracle")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("token hit rate (engine-reported cached ÷ prompt tokens)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_replica_load(runs: Mapping[str, Sequence[MetricsSample]], path: Path, title: str) -> None:
    """Per router, per replica: running + waiting requests over time (from /metrics samples)."""
    plt = _pyplot()
    n = max(1, len(runs))
    fig, axes = plt.subplots(n, 1, figsize=(6.4, 1.6 * n + 0.6), dpi=80, sharex=True, squeeze=False)
    for ax, (label, samples) in zip(axes[:, 0], runs.items(), strict=False):
        by_replica: dict[str, tuple[list[float], list[float]]] = {}
        for s in samples:
            xs, ys = by_replica.setdefault(s.replica, ([], []))
            xs.append(s.t)
            ys.append(
                s.values.get("vllm:num_requests_running", 0.0)
                + s.values.get("vllm:num_requests_waiting", 0.0)
            )
        for i, (xs, ys) in enumerate(by_replica.values()):
            ax.plot(xs, ys, linewidth=0.8, label=f"r{i}")
        ax.set_ylabel(label, fontsize=7, rotation=0, ha="right", va="center")
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since replay start")
    fig.suptitle(title + " — running+waiting per replica", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def plot_sweep(
    points: Sequence[tuple[float, float, float, float]],
    path: Path,
    title: str,
    oracle_hit_rate: float | None = None,
    knob: str = "footprint_weight",
) -> None:
    """Sweep curves: (knob value, temperature, hit_rate, ttft_p99) -> two panels."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.0, 3.4), dpi=90)
    temps = sorted({p[1] for p in points})
    for temp in temps:
        pts = sorted((p for p in points if p[1] == temp), key=lambda p: p[0])
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[2] for p in pts], marker="o", label=f"T={temp:g}")
        ax2.plot(xs, [p[3] for p in pts], marker="o", label=f"T={temp:g}")
    for ax in (ax1, ax2):
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlabel(knob)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if oracle_hit_rate is not None:
        ax1.axhline(oracle_hit_rate, color="#c44e52", linestyle="--", label="oracle")
        ax1.legend(fontsize=7)
    ax1.set_ylabel("token hit rate")
    ax2.set_ylabel("TTFT p99 (s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
