"""``kvgate bench``: trace replay across routers and policies.

Sub-commands:
  oracle   the trace slice's prefix reuse with one infinite cache, and the TTFT floor
  replay   replay a trace against any OpenAI-compatible URL
  compare  every router on a cold simulated fleet, same trace slice, one table
  sweep    kvgate ``kv``: one knob's values x temperature, hit rate and p99 TTFT curves
  matrix   the generalization matrix: engine models x traffic x fleet sizes (bench/matrix.py)
  faults   requests lost, phantom hits and recovery through crashes, restarts and lossy
           event wires (bench/faults.py; ``kvgate bench faults --help``)
  overload routers side by side from below to above the saturating session rate (goodput)
  pd       aggregated against disaggregated (2 prefill + 2 decode) routers, kvgate and its
           peers' P/D modes, repeated: TTFT, inter-token latency, engine hit rate, skipped
           prefill legs and transfers, medians (bench/pd.py)
  room-wait  from finished runs' records: the requests that lacked KV room where they were
           sent, their wait for it there, and on the replica that freed room first
  epp      kvgate as the endpoint picker of a real Envoy against kvgate serve, side by side
           (bench/epp.py; ``kvgate bench epp --help``)
  tail     from finished runs' records and kvgate's access log: the slowest requests by
           cause (a first turn, a history kept, lost before or after routing, moved)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from kvgate.bench import matrix, pd, report, room_wait, tail
from kvgate.bench.args import (
    compare_config,
    fleet_args,
    fleet_spec,
    load_requests,
    replay_args,
    replay_config,
    trace_args,
)
from kvgate.bench.compare import (
    ALL_ROUTERS,
    BASELINE_TREE,
    KVGATE_POLICIES,
    KVGATE_VARIANTS,
    RouterRun,
    compare,
    references,
    router_label,
)
from kvgate.bench.dynamo_peer import DYNAMO, DYNAMO_ROUTERS
from kvgate.bench.engines import needs_private_netns
from kvgate.bench.fleet import FleetSpec
from kvgate.bench.netns import only_loopback, reexec_private
from kvgate.bench.oracle import oracle
from kvgate.bench.overload import PointResult, run_point, write_ramp
from kvgate.bench.peers import ENGINES_DIR, PEERS, ensure_installed
from kvgate.bench.replay import replay, select_slice, write_records
from kvgate.bench.results import results_dir

DEFAULT_OUT = results_dir()


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
    cfg = replay_config(args, "http://unused", block)
    chosen = select_slice(reqs, cfg)
    o = oracle(chosen, block_tokens=block)
    refs = references(chosen, fleet_spec(args), block, args.out, cfg)
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
    cfg = replay_config(args, args.target, block)
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
    known = (
        set(KVGATE_POLICIES)
        | set(KVGATE_VARIANTS)
        | set(PEERS)
        | set(DYNAMO_ROUTERS)
        | {BASELINE_TREE}
    )
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown router(s) {unknown}; choose from {sorted(known)} or 'all'")
    return names


def _record_command(out: Path, argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text("kvgate bench " + " ".join(argv) + "\n")


def cmd_compare(args: argparse.Namespace, argv: list[str]) -> int:
    reqs, block = load_requests(args)
    out = _out_dir(args, "compare")
    _record_command(out, argv)
    cfg = compare_config(args, block, out, _trace_title(args))
    runs = [RouterRun(n, router_label(n)) for n in _parse_routers(args.routers)]
    compare(runs, reqs, cfg)
    print(f"results in {out}", file=sys.stderr)
    return 0


def cmd_pd(args: argparse.Namespace, argv: list[str]) -> int:
    """Each repeat: every router on a cold fleet, the same slice; medians in pd_table.md."""
    reqs, block = load_requests(args)
    out = _out_dir(args, "pd")
    _record_command(out, argv)
    runs = [RouterRun(n, router_label(n)) for n in _parse_routers(args.routers)]
    rows: list[pd.PdRow] = []
    title = _trace_title(args) + ": aggregated vs P/D (half the replicas prefill, half decode)"
    for repeat in range(args.repeat):
        cfg = compare_config(args, block, out / f"run{repeat + 1}", f"{title}, run {repeat + 1}")
        outputs = compare(runs, reqs, cfg)
        rows += [pd.PdRow(o.summary.label, o.summary, o.pd_stats) for o in outputs if o.pd_stats]
        table = f"## {title}: medians of {repeat + 1} run(s)\n\n{pd.median_table(rows)}"
        (out / "pd_table.md").write_text(table)  # kept current: a cut run keeps its repeats
    print(table)
    print(f"results in {out}", file=sys.stderr)
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    reqs, block = load_requests(args)
    out = _out_dir(args, "sweep")
    _record_command(out, argv)
    knob = args.knob
    cfg = compare_config(args, block, out, _trace_title(args) + f", kv sweep of {knob}")
    runs = [
        RouterRun("kv", f"kv {knob}={v:g} T={t:g}", ((knob, f"{v:g}"), ("temperature", f"{t:g}")))
        for t in _floats(args.temperature)
        for v in _floats(args.values)
    ]
    outputs = compare(runs, reqs, cfg)
    points = [
        (
            float(dict(r.knobs)[knob]),
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
    report.plot_sweep(points, out / "sweep.png", cfg.title, oracle_rate, knob)
    (out / "sweep.json").write_text(
        json.dumps(
            [
                dict(zip((knob, "temperature", "hit_rate", "ttft_p99_s"), p, strict=True))
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
    base_seed = args.seed
    for repeat in range(args.repeat):
        if args.seed_per_repeat:
            args.seed = base_seed + repeat  # another layout of session starts each repeat
        for factor in _floats(args.points):
            args.session_rate = factor * args.saturation_rate
            reqs, block = load_requests(args)
            point_title = f"{_trace_title(args)}, {factor:g} x saturation, run {repeat + 1}"
            point_title += f", seed {args.seed}" if args.seed_per_repeat else ""
            cfg = compare_config(args, block, out / f"x{factor:g}-run{repeat + 1}", point_title)
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
        description=__doc__.replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "oracle",
        help="prefix reuse of a trace slice with one infinite cache, and the TTFT floor "
        "(each request alone on an idle simulated replica with that cache)",
    )
    trace_args(p)
    replay_args(p)
    fleet_args(p)

    p = sub.add_parser("replay", help="replay a trace against an OpenAI-compatible URL")
    trace_args(p)
    replay_args(p)
    p.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--label", default="target", help="name of the target in tables and plots")
    p.add_argument("--replicas", type=int, default=4, help="replicas behind the target")

    p = sub.add_parser("compare", help="all routers on the same cold fleet and trace slice")
    trace_args(p)
    replay_args(p)
    fleet_args(p)
    p.add_argument(
        "--routers",
        default="all",
        help=f"comma list of {sorted(set(KVGATE_POLICIES) | set(PEERS) | set(DYNAMO_ROUTERS))} "
        "or 'all'",
    )

    p = sub.add_parser(
        "pd", help="aggregated vs disaggregated routers (kvgate, smg, vllm-router), repeated"
    )
    trace_args(p)
    replay_args(p)
    fleet_args(p)
    p.add_argument(
        "--routers",
        default="kv,smg_cache_aware,kv_pd,vllm_router_pd,kv_pd_sglang,smg_pd",
        help="comma list of routers (P/D ones: kv_pd, kv_pd_sglang, smg_pd, vllm_router_pd)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of every router (medians)")

    p = sub.add_parser("sweep", help="kv policy: one knob's values x temperature")
    trace_args(p)
    replay_args(p)
    fleet_args(p)
    p.add_argument("--knob", default="footprint_weight", help="a kv scoring knob (KvPolicyConfig)")
    p.add_argument("--values", default="0,0.25,0.5,1", help="comma list of the knob's values")
    p.add_argument("--temperature", default="0", help="comma list of scoring temperatures to cross")

    p = sub.add_parser(
        "matrix",
        help="the generalization matrix: a base cell and one-factor variations, every "
        "router repeated per cell, medians (docs/benchmarks.md)",
    )
    matrix.add_arguments(p)

    p = sub.add_parser(
        "overload", help="routers side by side on a ramp of session rates around saturation"
    )
    trace_args(p)
    replay_args(p)
    fleet_args(p)
    p.add_argument(
        "--routers", default="kv,kv_noqueue,vllm_kv_aware", help="comma list of routers to ramp"
    )
    p.add_argument(
        "--saturation-rate",
        type=float,
        default=0.22 / 1.5,
        help="the session rate that saturates the fleet (default: agentic_sessions on 4 "
        "replicas, docs/benchmarks.md)",
    )
    p.add_argument("--points", default="0.5,1,1.5,2", help="load points, x saturation")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="a kvgate checkout for router kv_baseline (kv from that tree, side by side)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of every point")
    p.add_argument(
        "--seed-per-repeat",
        action="store_true",
        help="repeat N lays the sessions out with seed --seed + N - 1 (other arrival bursts) "
        "instead of replaying one slice",
    )

    p = sub.add_parser(
        "room-wait",
        help="from finished runs' records: requests that lacked KV room where they were sent, "
        "their wait there, with hindsight, and by a residual-life estimate (bench/room_wait.py)",
    )
    room_wait.add_arguments(p)

    p = sub.add_parser(
        "tail",
        help="from finished runs' records (and kvgate's access log): why the slowest "
        "requests were slow, by cause (bench/tail.py)",
    )
    tail.add_arguments(p)
    return parser


def cmd_matrix(args: argparse.Namespace) -> int:
    # SIGTERM (the lead's scheduler, a timeout) unwinds like Ctrl-C: every run's finally
    # stops its fleet and router instead of leaving them behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = matrix.config_from_args(args, _out_dir(args, "matrix"))
    results = matrix.run_matrix(cfg)
    print(matrix.write_matrix(results, cfg))
    print(f"results in {cfg.out}", file=sys.stderr)
    return 0


def _routers_and_engines(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The routers a run starts and the engines of its fleets."""
    if args.command == "matrix":
        cfg = matrix.config_from_args(args, DEFAULT_OUT)
        return list(cfg.routers), matrix.cell_engines(cfg.cells)
    routers = _parse_routers(args.routers) if hasattr(args, "routers") else []
    return routers, [getattr(args, "engine", "sim")]


def _enter_private_netns(args: argparse.Namespace, argv: list[str]) -> None:
    """A run that starts Dynamo (its KV router, or its mocker as the fleet) or real vLLM
    replicas re-executes itself in a private network namespace, once every peer it needs
    is installed (the namespace has no route to a package registry): bench/netns.py."""
    routers, engines = _routers_and_engines(args)
    private = any(r in DYNAMO_ROUTERS for r in routers) or any(
        needs_private_netns(FleetSpec(engine=e)) for e in engines
    )
    if not private or only_loopback():
        return
    logs = ENGINES_DIR / "logs"
    packages = {PEERS[r].package.name: PEERS[r].package for r in routers if r in PEERS}
    for package in [*packages.values(), DYNAMO]:
        ensure_installed(package, logs)
    print("running in a private network namespace (bench/netns.py)", file=sys.stderr)
    reexec_private([sys.executable, "-m", "kvgate.router.cli", "bench", *argv])


def main(argv: list[str]) -> int:
    if argv[:1] == ["epp"]:  # its own parser: no trace, its own fleet, Envoy and load
        from kvgate.bench import epp  # noqa: PLC0415 - imported only for this sub-command

        return epp.cli(argv[1:])
    if argv[:1] == ["faults"]:  # its own parser: no trace, its own fleet and load
        from kvgate.bench import faults  # noqa: PLC0415 - imported only for this sub-command

        return faults.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in {"oracle", "compare", "sweep", "overload", "matrix", "pd"}:
        _enter_private_netns(args, argv)
    if args.command == "oracle":
        return cmd_oracle(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "compare":
        return cmd_compare(args, argv)
    if args.command == "overload":
        return cmd_overload(args, argv)
    if args.command == "pd":
        return cmd_pd(args, argv)
    if args.command == "matrix":
        return cmd_matrix(args)
    if args.command == "room-wait":
        return room_wait.main(args)
    if args.command == "tail":
        return tail.main(args)
    return cmd_sweep(args, argv)
