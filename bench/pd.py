"""Prefill/decode disaggregation in a comparison: what the replicas themselves count of each
run (prompt tokens computed, KV transfers and their tokens, transfers that brought nothing the
decode replica lacked) and the client's inter-token latency; ``kvgate bench pd`` repeats a
comparison of aggregated and disaggregated routers and writes the medians (docs/benchmarks.md).

Hit rates are the engines' here, not the answers' ``cached_tokens``: a decode replica reports
transferred tokens as cached (vLLM does), which would make every P/D run look like a full hit.
``1 - computed / prompt`` counts, for aggregated and disaggregated fleets alike, the prompt
tokens no replica had to compute; both are counted by the replicas as requests are admitted
(``prompt``: every admitted request's prompt once, its prefill leg's not counted again).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvgate.bench import report
from kvgate.bench.replay import RequestRecord, metrics_texts

FLEET_SERIES: dict[str, tuple[str, str]] = {
    "admitted_tokens": ("vllm:prompt_tokens_total", ""),
    "prefill_leg_tokens": ("kvgate_sim_prefill_leg_prompt_tokens_total", ""),
    "computed_tokens": ("vllm:prompt_tokens_by_source_total", 'source="local_compute"'),
    "transferred_tokens": ("kvgate_sim_kv_transfer_tokens_total", ""),
    "transfers_used": ("kvgate_sim_kv_transfers_total", 'outcome="used"'),
    "transfers_redundant": ("kvgate_sim_kv_transfers_total", 'outcome="redundant"'),
}
"""Counters summed over the replicas: name -> (series, a label its lines must carry)."""
ROUTER_SERIES: dict[str, tuple[str, str]] = {
    "skipped": ("kvgate_pd_legs_total", 'outcome="skipped"'),
}
"""kvgate's own count of prefill legs it skipped (a peer never skips one)."""


def parse_series(text: str, series: Mapping[str, tuple[str, str]]) -> dict[str, float]:
    """Each key of ``series``: the sum of its metric's lines carrying its label."""
    out = dict.fromkeys(series, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        for key, (name, label) in series.items():
            if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
                continue
            if label and label not in line.partition("}")[0]:
                continue
            try:
                out[key] += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return out


def scrape_series(urls: Sequence[str], series: Mapping[str, tuple[str, str]]) -> dict[str, float]:
    """``parse_series`` of each ``url``'s /metrics, summed (an unreachable one counts 0)."""
    total = dict.fromkeys(series, 0.0)
    for text in metrics_texts(urls).values():
        for key, value in parse_series(text, series).items():
            total[key] += value
    return total


@dataclass(frozen=True, slots=True)
class PdStats:
    """One run's disaggregation figures (an aggregated run has no transfers)."""

    prompt_tokens: float
    """Prompt tokens of the requests the replicas admitted (a prefill leg's not again)."""
    computed_tokens: float
    """Prompt tokens the replicas computed (vLLM's ``local_compute`` source)."""
    engine_hit_rate: float
    """``1 - computed / prompt``: the share no replica computed."""
    transfers: float
    transferred_tokens: float
    redundant_transfers: float
    """Transfers whose every block the decode replica already held (the leg could have
    been skipped)."""
    skipped: float | None
    """Prefill legs kvgate skipped (None: the router does not say)."""
    itl_p50_s: float
    itl_p99_s: float
    counters: dict[str, float] = field(default_factory=dict)
    """The counters' changes over the run, as read (``FLEET_SERIES``, ``skipped``)."""


def inter_token_s(records: Sequence[RequestRecord]) -> list[float]:
    """Per answered request with two or more tokens: its mean time between tokens after the
    first (the client's view)."""
    out: list[float] = []
    for r in records:
        if r.status != "ok" or r.ttft_s is None or r.e2e_s is None or r.output_tokens < 2:
            continue
        out.append((r.e2e_s - r.ttft_s) / (r.output_tokens - 1))
    return out


def pd_stats(
    records: Sequence[RequestRecord], before: Mapping[str, float], after: Mapping[str, float]
) -> PdStats:
    """One run's figures from its records and the counters read before and after it
    (``skipped`` among them when the router tells)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt = delta("admitted_tokens") - delta("prefill_leg_tokens")
    computed = delta("computed_tokens")
    itl = inter_token_s(records)
    return PdStats(
        prompt_tokens=prompt,
        computed_tokens=computed,
        engine_hit_rate=1.0 - computed / prompt if prompt else math.nan,
        transfers=delta("transfers_used") + delta("transfers_redundant"),
        transferred_tokens=delta("transferred_tokens"),
        redundant_transfers=delta("transfers_redundant"),
        skipped=delta("skipped") if "skipped" in after else None,
        itl_p50_s=report.percentile(itl, 50) if itl else math.nan,
        itl_p99_s=report.percentile(itl, 99) if itl else math.nan,
        counters={key: delta(key) for key in after},
    )


def write_stats(path: Path, stats: PdStats) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(stats), indent=2) + "\n")


# --- medians over repeated comparisons -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class PdRow:
    """One router's run in a repeated P/D comparison."""

    label: str
    summary: report.RunSummary
    stats: PdStats


COLUMNS = (
    "router",
    "answered",
    "TTFT p50 s",
    "TTFT p99 s [range]",
    "ITL p50 ms",
    "ITL p99 ms",
    "engine hit",
    "prefill legs skipped",
    "transfers",
    "transferred tokens",
    "redundant transfers",
)


def _median(values: Sequence[float | None]) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def _with_range(values: Sequence[float]) -> str:
    """``median [min-max]`` of several runs' values, an en dash between (one run: the value)."""
    kept = [v for v in values if not math.isnan(v)]
    if len(kept) < 2:
        return f"{_median(kept):.2f}"
    return f"{statistics.median(kept):.2f} [{min(kept):.2f}–{max(kept):.2f}]"


def median_table(rows: Sequence[PdRow]) -> str:
    """Markdown: per router (first-seen order), the median over its runs of each column."""
    by_label: dict[str, list[PdRow]] = {}
    for row in rows:
        by_label.setdefault(row.label, []).append(row)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for label, runs in by_label.items():
        s = [r.summary for r in runs]
        p = [r.stats for r in runs]
        skipped = _median([x.skipped for x in p])
        cells = [
            f"{label} ({len(runs)} runs)",
            f"{_median([x.ok for x in s]):.0f}/{_median([x.requests for x in s]):.0f}",
            f"{_median([x.ttft_p50_s for x in s]):.3f}",
            _with_range([x.ttft_p99_s for x in s]),
            f"{1000 * _median([x.itl_p50_s for x in p]):.1f}",
            f"{1000 * _median([x.itl_p99_s for x in p]):.1f}",
            f"{_median([x.engine_hit_rate for x in p]):.3f}",
            "—" if math.isnan(skipped) else f"{skipped:.0f}",
            f"{_median([x.transfers for x in p]):.0f}",
            f"{_median([x.transferred_tokens for x in p]):,.0f}",
            f"{_median([x.redundant_transfers for x in p]):.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rows_from(out: Path) -> list[PdRow]:
    """The rows of a finished ``kvgate bench pd`` run, read back from ``out``: each repeat's
    ``run*/<router>/summary.json`` and ``pd.json``, in the order the routers ran."""
    rows: list[PdRow] = []
    for run in sorted(out.glob("run*"), key=lambda p: int(p.name[3:] or 0)):
        summaries = json.loads((run / "summaries.json").read_text())["runs"]
        for entry in summaries:
            folder = run / report.run_dir_name(entry["label"])
            stats = json.loads((folder / "pd.json").read_text())
            summary = report.read_summary(folder / "summary.json")
            rows.append(PdRow(summary.label, summary, PdStats(**stats)))
    return rows


def main(argv: Sequence[str]) -> int:
    """``python -m kvgate.bench.pd OUT``: the medians table of a finished run, again."""
    if len(argv) != 1:
        print("usage: python -m kvgate.bench.pd OUT_DIR")
        return 2
    print(median_table(rows_from(Path(argv[0]))), end="")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
