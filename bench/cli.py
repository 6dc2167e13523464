"""``kvgate bench``: trace replay across routers and policies.

Sub-commands:
  oracle   the trace slice's prefix reuse with one infinite cache, and the TTFT floor
  replay   replay a trace against any OpenAI-compatible URL
  compare  every router on a cold simulated fleet, same trace slice, one table
  sweep    kvgate ``kv``: overlap_credit x temperature, hit rate and p99 TTFT curves
  faults   requests lost, phantom hits and recovery through crashes, restarts and lossy
           event wires (bench/faults.py; ``kvgate bench faults --help``)
  overload routers side by side from below to above the saturating session rate (goodput)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from dataclasses import asdict
from pathlib import Path

from bench import report
from bench.compare import (
    ALL_ROUTERS,
    KVGATE_POLICIES,
    KVGATE_VARIANTS,
    CompareConfig,
    RouterRun,
    compare,
    references,
    router_label,
)
from bench.fleet import FleetSpec
from bench.oracle import oracle
from bench.overload import PointResult, run_point, write_ramp
from bench.peers import PEERS
from bench.replay import ReplayConfig, replay, select_slice, write_records
from bench.traces import (
    TRACE_BLOCK_TOKENS,
    AgenticReplayOptions,
    SyntheticAgentOptions,
    TraceRequest,
    filter_long,
    load_trace,
    scale_request,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument(
        "--trace", required=True, help="trace path (Mooncake or agentic JSONL[.gz]) or 'synthetic'"
    )
    g.add_argument("--limit", type=int, help="keep the first N requests of the trace")
    g.add_argument("--skip", type=int, default=0, help="Mooncake: drop the first N requests")
    g.add_argument(
        "--session-rate",
        type=float,
        default=0.5,
        help="agentic/synthetic: sessions started per second (Poisson)",
    )
    g.add_argument(
        "--max-gap",
        type=float,
        default=30.0,
        help="agentic/synthetic: cap on idle gaps between turns (trace seconds)",
    )
    g.add_argument("--max-sessions", type=int, help="agentic: keep the first N sessions")
    g.add_argument(
        "--max-input-tokens", type=int, help="drop requests longer than this (a context window)"
    )
    g.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="shrink every block to 512*scale words (only when the box cannot keep up)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--syn-sessions", type=int, default=16, help="synthetic: sessions")
    g.add_argument("--syn-turns", type=int, default=12, help="synthetic: turns per session")


def _replay_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replay")
    g.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="divide arrival times (and the simulator's timing) by this",
    )
    g.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="extra compression of arrivals only (load above the trace's own)",
    )
    g.add_argument("--max-requests", type=int, help="send at most N requests")
    g.add_argument(
        "--duration", type=float, help="send the requests scheduled within this many wall seconds"
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="after the last send, wait this long for answers, then cancel",
    )
    g.add_argument("--model", default="kvgate-sim")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--out", type=Path, help="results folder (default bench/results/<stamp>)")


def _fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated fleet")
    g.add_argument("--replicas", type=int, default=4)
    g.add_argument("--capacity-blocks", type=int, help="KV cache capacity of each replica")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--topic",
        default="",
        help="KV events topic (empty: vllm-router kv_aware reads only empty topics)",
    )
    g.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        help="extra argument for `kvgate sim` (repeatable)",
    )
    g.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra argument for `kvgate serve` (repeatable)",
    )


def load_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], int]:
    """The trace after filters and scaling, and the tokens per hash id it now uses."""
    agentic = AgenticReplayOptions(args.session_rate, args.max_gap, args.max_sessions, args.seed)
    synthetic = SyntheticAgentOptions(
        sessions=args.syn_sessions,
        turns=args.syn_turns,
        session_rate=args.session_rate,
        max_gap_s=args.max_gap,
        seed=args.seed,
    )
    reqs = load_trace(
        args.trace, limit=args.limit, skip=args.skip, agentic=agentic, synthetic=synthetic
    )
    reqs = filter_long(reqs, args.max_input_tokens)
    block = TRACE_BLOCK_TOKENS
    if args.token_scale != 1.0:
        reqs = [scale_request(r, args.token_scale) for r in reqs]
        block = max(1, round(TRACE_BLOCK_TOKENS * args.token_scale))
    return reqs, block


def _replay_config(args: argparse.Namespace, target: str, block: int) -> ReplayConfig:
    return ReplayConfig(
        target=target.rstrip("/"),
        model=args.model,
        speedup=args.speedup * args.rate_scale,
        max_requests=args.max_requests,
        max_duration_s=args.duration,
        drain_timeout_s=args.drain_timeout,
        block_tokens=block,
        progress=not args.no_progress,
    )


def _out_dir(args: argparse.Namespace, kind: str) -> Path:
    if args.out is not None:
        return Path(args.out)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return DEFAULT_OUT / f"{kind}-{stamp}"


def _trace_title(args: argparse.Namespace) -> str:
    name = Path(args.trace).name.split(".")[0] if args.trace != "synthetic" else "synthetic agents"
    rate = f" x{args.rate_scale:g} rate" if args.rate_scale != 1.0 else ""
    return f"{name}, {args.replicas} replicas, speedup {args.speedup:g}{rate}"


# --- sub-commands -------------------------------------------------------------------------


def cmd_oracle(args: argparse.Namespace) -> int:
    reqs, block = load_requests(args)
    cfg = _replay_config(args, "http://unused", block)
    chosen = select_slice(reqs, cfg)
    o = oracle(chosen, block_tokens=block)
    refs = references(chosen, _fleet_spec(args), block)
    print(
        json.dumps(
            {
                "requests": o.requests,
                "prompt_tokens": o.prompt_tokens,
                "token_hit_rate": round(o.token_hit_rate, 4),
                "block_hit_rate": round(o.block_hit_rate, 4),
            }
            | refs.as_json()
        )
    )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    reqs, block = load_requests(args)
    cfg = _replay_config(args, args.target, block)
    chosen = select_slice(reqs, cfg)
    o = oracle(chosen, block_tokens=block)
    result = asyncio.run(replay(chosen, cfg))
    out = _out_dir(args, "replay")
    write_records(out / "records.jsonl", result.records)
    summary = report.summarize(
        args.label,
        result.records,
        oracle_hit_rate=o.token_hit_rate,
        wall_s=result.wall_s,
        replicas=args.replicas,
    )
    report.write_summary(out / "summary.json", summary)
    table = report.markdown_table([summary], report.References(o.token_hit_rate))
    (out / "table.md").write_text(table)
    report.plot_ttft_cdf({args.label: result.records}, out / "ttft_cdf.png", args.label)
    print(table)
    print(f"results in {out}", file=sys.stderr)
    return 0


def _parse_routers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(ALL_ROUTERS)
    known = set(KVGATE_POLICIES) | set(KVGATE_VARIANTS) | set(PEERS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown router(s) {unknown}; choose from {sorted(known)} or 'all'")
    return names


def _fleet_spec(args: argparse.Namespace) -> FleetSpec:
    return FleetSpec(
        replicas=args.replicas,
        speedup=args.speedup,
        capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        topic=args.topic,
        extra_args=tuple(args.sim_arg),
    )


def _compare_config(args: argparse.Namespace, block: int, out: Path, title: str) -> CompareConfig:
    return CompareConfig(
        fleet=_fleet_spec(args),
        replay=_replay_config(args, "http://unset", block),
        out_dir=out,
        title=title,
        trace_block_tokens=block,
        kvgate_extra_args=tuple(args.serve_arg),
    )


def _record_command(out: Path, argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("kvgate bench " + " ".join(argv) + "\n")


def cmd_compare(args: argparse.Namespace, argv: list[str]) -> int:
    reqs, block = load_requests(args)
    out = _out_dir(args, "compare")
    _record_command(out, argv)
    cfg = _compare_config(args, block, out, _trace_title(args))
    runs = [RouterRun(n, router_label(n)) for n in _parse_routers(args.routers)]
    compare(runs, reqs, cfg)
    print(f"results in {out}", file=sys.stderr)
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    reqs, block = load_requests(args)
    out = _out_dir(args, "sweep")
    _record_command(out, argv)
    cfg = _compare_config(args, block, out, _trace_title(args) + ", kv sweep")
    runs = [
        RouterRun(
            "kv",
            f"kv credit={c:g} T={t:g}",
            (("overlap_credit", f"{c:g}"), ("temperature", f"{t:g}")),
        )
        for t in _floats(args.temperature)
        for c in _floats(args.overlap_credit)
    ]
    outputs = compare(runs, reqs, cfg)
    points = [
        (
            float(dict(r.knobs)["overlap_credit"]),
            float(dict(r.knobs)["temperature"]),
            o.summary.hit_rate,
            o.summary.ttft_p99_s,
        )
        for r, o in zip(runs, outputs, strict=True)
    ]
    oracle_rate = next(
        (o.summary.hit_rate / o.summary.hit_vs_oracle for o in outputs if o.summary.hit_vs_oracle),
        None,
    )
    report.plot_sweep(points, out / "sweep.png", cfg.title, oracle_rate)
    (out / "sweep.json").write_text(
        json.dumps(
            [
                dict(
                    zip(("overlap_credit", "temperature", "hit_rate", "ttft_p99_s"), p, strict=True)
                )
                | {"summary": asdict(o.summary)}
                for p, o in zip(points, outputs, strict=True)
            ],
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"results in {out}", file=sys.stderr)
    return 0


def cmd_overload(args: argparse.Namespace, argv: list[str]) -> int:
    """Each repeat, each point: every router on the slice at ``factor x saturation``."""
    out = _out_dir(args, "overload")
    _record_command(out, argv)
    runs = [RouterRun(n, router_label(n)) for n in _parse_routers(args.routers)]
    title = _trace_title(args) + f", overload ramp (saturation {args.saturation_rate:g})"
    results: list[PointResult] = []
    for repeat in range(args.repeat):
        for factor in _floats(args.points):
            args.session_rate = factor * args.saturation_rate
            reqs, block = load_requests(args)
            point_title = f"{_trace_title(args)}, {factor:g} x saturation, run {repeat + 1}"
            cfg = _compare_config(args, block, out / f"x{factor:g}-run{repeat + 1}", point_title)
            results += run_point(
                runs,
                reqs,
                cfg,
                factor=factor,
                rate=args.session_rate,
                repeat=repeat,
                slo_s=args.slo,
            )
            write_ramp(results, out, args.slo, title)  # kept current: a cut run keeps its points
    print(write_ramp(results, out, args.slo, title))
    print(f"results in {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "oracle",
        help="prefix reuse of a trace slice with one infinite cache, and the TTFT floor "
        "(each request alone on an idle simulated replica with that cache)",
    )
    _trace_args(p)
    _replay_args(p)
    _fleet_args(p)

    p = sub.add_parser("replay", help="replay a trace against an OpenAI-compatible URL")
    _trace_args(p)
    _replay_args(p)
    p.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--label", default="target")
    p.add_argument("--replicas", type=int, default=4, help="replicas behind the target")

    p = sub.add_parser("compare", help="all routers on the same cold fleet and trace slice")
    _trace_args(p)
    _replay_args(p)
    _fleet_args(p)
    p.add_argument(
        "--routers",
        default="all",
        help=f"comma list of {sorted(set(KVGATE_POLICIES) | set(PEERS))} or 'all'",
    )

    p = sub.add_parser("sweep", help="kv policy: overlap_credit x temperature")
    _trace_args(p)
    _replay_args(p)
    _fleet_args(p)
    p.add_argument("--overlap-credit", default="0,0.25,0.5,1,2,4")
    p.add_argument("--temperature", default="0,0.1")
    p = sub.add_parser(
        "overload", help="routers side by side on a ramp of session rates around saturation"
    )
    _trace_args(p)
    _replay_args(p)
    _fleet_args(p)
    p.add_argument("--routers", default="kv,kv_noqueue,vllm_kv_aware")
    p.add_argument(
        "--saturation-rate",
        type=float,
        default=0.22 / 1.5,
        help="the session rate that saturates the fleet (default: agentic_sessions on 4 "
        "replicas, docs/benchmarks.md)",
    )
    p.add_argument("--points", default="0.5,1,1.5,2", help="load points, x saturation")
    p.add_argument("--repeat", type=int, default=1, help="runs of every point")
    p.add_argument("--slo", type=float, default=5.0, help="goodput's TTFT objective, seconds")
    return parser


def main(argv: list[str]) -> int:
    if argv[:1] == ["faults"]:  # its own parser: no trace, its own fleet and load
        from bench import faults  # noqa: PLC0415 - imported only for this sub-command

        return faults.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "oracle":
        return cmd_oracle(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "compare":
        return cmd_compare(args, argv)
    if args.command == "overload":
        return cmd_overload(args, argv)
    return cmd_sweep(args, argv)
