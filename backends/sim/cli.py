"""``kvgate sim``: run a simulated vLLM-like fleet in one process until Ctrl-C.

    kvgate sim --replicas 4 --port 9001 --events-port 5557

Replica i serves HTTP on ``port + i``, publishes KV events on ``events-port + 2 i`` and
answers replays on ``events-port + 2 i + 1``. See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

import uvloop
import zmq

from kvgate.backends.sim.config import (
    ApiConfig,
    ConfigError,
    EngineConfig,
    EventsConfig,
    LoraModule,
    SimConfig,
    StartupFaults,
    TimingConfig,
)
from kvgate.backends.sim.fleet import SimFleet

log = logging.getLogger("kvgate.sim")


def build_parser() -> argparse.ArgumentParser:
    e, t, v, a = EngineConfig(), TimingConfig(), EventsConfig(), ApiConfig()
    p = argparse.ArgumentParser(
        prog="kvgate sim",
        description="Simulated vLLM-like replicas: OpenAI API, vLLM metrics, prefix cache, "
        "KV events (ZMQ), faults. Defaults model Llama-3.1-8B on one H100 (docs/simulator.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--replicas", type=int, default=4, help="replicas in this process")
    fleet.add_argument(
        "--first-replica", type=int, default=0, metavar="I",
        help="index of this process's first replica, for a fleet split over processes "
        "(its ports and seeds are those of replica I of one whole fleet)",
    )  # fmt: skip
    fleet.add_argument("--host", default="127.0.0.1", help="bind address of every socket")
    fleet.add_argument("--port", type=int, default=9001, help="HTTP port of replica 0 (+i)")
    fleet.add_argument(
        "--events-port", type=int, default=5557,
        help="KV-event PUB port of replica 0 (+2i); replay ROUTER on the next port",
    )  # fmt: skip
    fleet.add_argument(
        "--dp-size", type=int, default=1, metavar="D",
        help="data-parallel ranks per replica, each its own engine and cache (vLLM "
        "--data-parallel-size): rank r publishes on the replica's events port + r, replays "
        "on its replay port + r (ports per replica: 2D)",
    )  # fmt: skip
    fleet.add_argument("--model", default=e.model, help="served model name")
    fleet.add_argument("--seed", type=int, default=0, help="seed of outputs, hashes, faults")
    fleet.add_argument("--log-level", default="warning", help="python logging level")
    fleet.add_argument(
        "--parent-pid", type=int, metavar="PID",
        help="stop once PID is no longer this process's parent (it exited, even killed "
        "outright); kvgate serve --sim passes its own",
    )  # fmt: skip

    eng = p.add_argument_group("engine and cache")
    eng.add_argument("--block-size", type=int, default=e.block_size, help="tokens per block")
    eng.add_argument("--capacity-blocks", type=int, default=e.capacity_blocks,
                     help="GPU KV-cache blocks per replica")  # fmt: skip
    eng.add_argument("--cpu-offload-blocks", type=int, default=e.cpu_offload_blocks,
                     help="CPU tier blocks per replica (0: no CPU tier)")  # fmt: skip
    eng.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="max batch")
    eng.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens,
                     help="token budget per step (chunked prefill)")  # fmt: skip
    eng.add_argument(
        "--prefill-mode", choices=("chunked", "serial"), default=e.prefill_mode,
        help="chunked: each step fills its budget with chunks of every queued prefill that "
        "fits; serial: one prefill at a time, first come first served (decodes still batch)",
    )  # fmt: skip
    eng.add_argument("--max-model-len", type=int, default=e.max_model_len,
                     help="max prompt + output tokens (capped by the cache size)")  # fmt: skip
    eng.add_argument("--default-max-tokens", type=int, default=e.default_max_tokens,
                     help="output tokens of a chat request without max_tokens")  # fmt: skip
    eng.add_argument(
        "--lora", nargs="+", action="extend", default=[], metavar="NAME[=PATH]",
        help="LoRA adapters served from the start (more: POST /v1/load_lora_adapter)",
    )  # fmt: skip

    api = p.add_argument_group("OpenAI server")
    api.add_argument(
        "--engine-kind", choices=("vllm", "trtllm"), default=a.engine_kind,
        help="the server presented: vllm, or trtllm (trtllm-serve's metrics at "
        "/prometheus/metrics, /health_generate, no /tokenize nor renderer; same KV events)",
    )  # fmt: skip
    api.add_argument(
        "--owned-by", choices=("vllm", "sglang"), default=a.owned_by,
        help="the engine /v1/models names as owner (sglang: a router such as smg then "
        "speaks SGLang's P/D bootstrap protocol to these replicas, which they serve)",
    )  # fmt: skip
    api.add_argument(
        "--stream-open", choices=("at_accept", "at_first_token"), default=a.stream_open,
        help="when a streaming response sends 200 and its headers: at_accept (vLLM: before "
        "the request queues and prefills) or with the first token",
    )  # fmt: skip
    api.add_argument("--responses-store", type=int, default=a.responses_store,
                     help="responses kept per replica (previous_response_id; 0: none)")  # fmt: skip
    api.add_argument("--responses-store-mib", type=int,
                     default=a.responses_store_bytes // 2**20,
                     help="conversation text the store keeps, MiB per replica")  # fmt: skip

    tim = p.add_argument_group("timing (per step: max(floor, tokens x token-us) + attention)")
    tim.add_argument("--speedup", type=float, default=t.speedup, help="divides every time")
    tim.add_argument("--catch-up-ms", type=float, default=t.catch_up_ms,
                     help="wall ms a replica may fall behind its model and make up")  # fmt: skip
    tim.add_argument("--step-floor-ms", type=float, default=t.step_floor_ms,
                     help="minimum step time (weights read once per step)")  # fmt: skip
    tim.add_argument("--token-us", type=float, default=t.token_us,
                     help="compute per token in the batch")  # fmt: skip
    tim.add_argument("--prefill-attn-ns", type=float, default=t.prefill_attn_ns,
                     help="prefill attention per (token x earlier token)")  # fmt: skip
    tim.add_argument("--decode-kv-ns", type=float, default=t.decode_kv_ns,
                     help="decode KV read per context token per sequence")  # fmt: skip
    tim.add_argument("--cpu-load-us-per-token", type=float, default=t.cpu_load_us_per_token,
                     help="cost of bringing a token back from the CPU tier")  # fmt: skip

    ev = p.add_argument_group("KV events")
    ev.add_argument("--event-encoding", choices=("map", "array"), default=v.encoding,
                    help="map: current vLLM; array: older vLLM and SGLang")  # fmt: skip
    ev.add_argument("--topic", default=v.topic, help="ZMQ topic frame ('' allowed)")
    ev.add_argument("--buffer-steps", type=int, default=v.buffer_steps, help="replay ring size")
    ev.add_argument("--buffer-mib", type=int, default=v.buffer_bytes // 2**20,
                    help="replay ring bound in MiB per replica")  # fmt: skip
    ev.add_argument("--hash-format", choices=("int", "bytes"), default=v.hash_format,
                    help="block hashes as uint64 or as 32 raw bytes")  # fmt: skip
    ev.add_argument("--kv-event-sources-format", choices=("object", "list"),
                    default=v.sources_format, help="shape of GET /kv_event_sources")  # fmt: skip

    flt = p.add_argument_group("faults from the start (more at run time: POST /sim/fault)")
    flt.add_argument("--fail-rate", type=float, default=0.0, help="share of requests -> 500")
    flt.add_argument("--drop-events-rate", type=float, default=0.0,
                     help="share of event batches not published (replayable seq gaps)")  # fmt: skip
    flt.add_argument("--event-delay-ms", type=float, default=0.0, help="delay every batch")
    flt.add_argument("--slowdown", type=float, default=1.0, help="multiplies step times")
    flt.add_argument("--prefill-slowdown", type=float, default=1.0,
                     help="multiplies the prefill share of step times")  # fmt: skip
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        replicas=args.replicas,
        first_replica=args.first_replica,
        host=args.host,
        port=args.port,
        events_port=args.events_port,
        seed=args.seed,
        dp_size=args.dp_size,
        engine=EngineConfig(
            model=args.model,
            block_size=args.block_size,
            capacity_blocks=args.capacity_blocks,
            cpu_offload_blocks=args.cpu_offload_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_mode=args.prefill_mode,
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
            lora_modules=tuple(LoraModule.parse(spec) for spec in args.lora),
        ),
        timing=TimingConfig(
            step_floor_ms=args.step_floor_ms,
            token_us=args.token_us,
            prefill_attn_ns=args.prefill_attn_ns,
            decode_kv_ns=args.decode_kv_ns,
            cpu_load_us_per_token=args.cpu_load_us_per_token,
            speedup=args.speedup,
            catch_up_ms=args.catch_up_ms,
        ),
        events=EventsConfig(
            encoding=args.event_encoding,
            topic=args.topic,
            buffer_steps=args.buffer_steps,
            buffer_bytes=args.buffer_mib * 2**20,
            hash_format=args.hash_format,
            sources_format=args.kv_event_sources_format,
        ),
        faults=StartupFaults(
            fail_rate=args.fail_rate,
            drop_events_rate=args.drop_events_rate,
            event_delay_s=args.event_delay_ms / 1000.0,
            slowdown=args.slowdown,
            prefill_slowdown=args.prefill_slowdown,
        ),
        api=ApiConfig(
            engine_kind=args.engine_kind,
            owned_by=args.owned_by,
            stream_open=args.stream_open,
            responses_store=args.responses_store,
            responses_store_bytes=args.responses_store_mib * 2**20,
        ),
    )


def describe(fleet: SimFleet) -> str:
    cfg = fleet.config
    e = cfg.engine
    cpu = f"{e.cpu_offload_blocks} CPU blocks" if e.cpu_offload_blocks else "no CPU tier"
    loras = ", ".join(m.name for m in e.lora_modules) or "none"
    lines = [
        f"kvgate sim: {cfg.replicas} replica(s) of model {e.model!r}: block size {e.block_size}, "
        f"{e.capacity_blocks} GPU blocks, {cpu}, {e.prefill_mode} prefill "
        f"(budget {e.max_num_batched_tokens}), speed-up x{cfg.timing.speedup:g}, "
        f"events {cfg.events.encoding}-encoded on topic {cfg.events.topic!r}",
        f"LoRA adapters: {loras}; streams open {cfg.api.stream_open}",
        "port scheme: HTTP port+i, KV events PUB events-port+2i, replay ROUTER events-port+2i+1",
    ]
    for i, (url, events, replay) in zip(cfg.indices, fleet.replicas, strict=True):
        lines.append(f"  replica {i}: {url}  events {events}  replay {replay}")
    lines += [
        f"tokenizer: {fleet.tokenizer.directory}",
        'faults: POST <replica>/sim/fault {"kind": ...}; state: GET <replica>/sim/state',
    ]
    return "\n".join(lines)


async def _watch_parent(parent: int, stop: asyncio.Event, interval_s: float = 0.5) -> None:
    """Set ``stop`` once this process is re-parented (its starter exited, even by SIGKILL)."""
    while not stop.is_set() and os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
    stop.set()


async def _serve(config: SimConfig, *, parent_pid: int | None = None) -> int:
    # Signal handlers go in before any listener opens: a SIGTERM that arrives while the
    # fleet starts (its first replicas already answering) still means a clean stop.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = None if parent_pid is None else asyncio.create_task(_watch_parent(parent_pid, stop))
    fleet = SimFleet(config)
    try:
        try:
            await fleet.start()
        except (OSError, zmq.ZMQError) as exc:
            print(f"kvgate sim: cannot listen: {exc}", file=sys.stderr)
            return 1
        try:
            print(describe(fleet), flush=True)
            await stop.wait()
        finally:
            await fleet.stop()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if watcher is not None:
            stop.set()
            await watcher
    return 0


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from_args(args)
    try:
        config.validate()
    except ConfigError as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(config, parent_pid=args.parent_pid))
