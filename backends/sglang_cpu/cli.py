"""``kvgate engines --engine sglang``: install SGLang, build the tiny model, run replicas.

kvgate engines --engine sglang install [--force] [--lock]
kvgate engines --engine sglang model [--out DIR] [--seed N] [--force]
kvgate engines --engine sglang up [--replicas 2] [--port 8201] [--events-port 5701] [--detach]
kvgate engines --engine sglang down
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
from kvgate.backends.sglang_cpu.install import SGLANG_VERSION, ensure_installed
from kvgate.backends.sglang_cpu.launch import (
    SglangFleet,
    SglangOptions,
    SglangStartError,
    iter_state_groups,
    plan_replicas,
    write_state,
)
from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.vllm_cpu.install import InstallError
from kvgate.backends.vllm_cpu.layout import ENGINES_DIR_HELP
from kvgate.backends.vllm_cpu.model import DEFAULT_SEED, ensure_model


def _say(message: str) -> None:
    print(f"kvgate engines: {message}", file=sys.stderr, flush=True)


def _install(args: argparse.Namespace, layout: SglangLayout) -> int:
    report = ensure_installed(layout, _say, force=args.force, lock=args.lock)
    state = "reused" if report.reused else f"installed in {report.seconds:.0f} s"
    _say(f"SGLang {SGLANG_VERSION} venv {layout.venv} {state}")
    return 0


def _model(args: argparse.Namespace, layout: SglangLayout) -> int:
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


def _up(args: argparse.Namespace, layout: SglangLayout) -> int:
    ensure_installed(layout, _say)
    ensure_model(layout.python, layout.model_dir, layout.logs / "model.log")
    options = SglangOptions(
        python=layout.python,
        model_dir=layout.model_dir,
        logs=layout.logs,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
    )
    fleet = SglangFleet(options, plan_replicas(args.replicas, args.port, args.events_port))
    started = time.monotonic()
    _say(f"starting {args.replicas} SGLang replicas (logs: {layout.logs}/sglang-replica-N.log)")
    fleet.start(ready_timeout=args.timeout)
    _say(f"ready in {time.monotonic() - started:.0f} s; run kvgate with:")
    flags = " ".join(f"--worker {flag}" for flag in fleet.worker_flags())
    print(f"kvgate serve {flags}", flush=True)
    if args.detach:
        write_state(layout.fleet_state, fleet)
        state = layout.fleet_state
        _say(f"detached; stop them with `kvgate engines --engine sglang down` ({state})")
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


def _down(args: argparse.Namespace, layout: SglangLayout) -> int:
    groups = list(iter_state_groups(layout.fleet_state))
    for pgid in groups:
        kill_group(pgid)
    layout.fleet_state.unlink(missing_ok=True)
    _say(f"stopped {len(groups)} SGLang replica process group(s)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate engines --engine sglang", description=__doc__.split("\n")[0].replace("``", "`")
    )
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="sglang", help=ENGINE_HELP)
    parser.add_argument("--dir", type=Path, default=None, help=ENGINES_DIR_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser(
        "install",
        help=f"create sglang-venv in the engines folder, with a pinned SGLang {SGLANG_VERSION}",
    )
    install.add_argument("--force", action="store_true", help="reinstall even when complete")
    install.add_argument(
        "--lock",
        action="store_true",
        help="reinstall resolving freely and pin the result in constraints-sglang.txt",
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
    up.add_argument("--port", type=int, default=8201, help="HTTP port of replica 0 (+i)")
    up.add_argument(
        "--events-port",
        type=int,
        default=5701,
        help="replica i publishes on PORT+3i, replays on PORT+3i+1, and its scheduler's "
        "torch.distributed port is PORT+3i+2 (all on 127.0.0.1)",
    )
    up.add_argument(
        "--page-size",
        type=int,
        default=32,
        help="tokens per KV page (kvgate adopts it); 32 matches the vLLM CPU replicas, so "
        "both engines can serve one model behind one kvgate",
    )
    up.add_argument(
        "--max-total-tokens",
        type=int,
        default=40960,
        help="KV pool per replica in tokens (memory: about 1 MB per 2k tokens for the tiny model)",
    )
    up.add_argument("--timeout", type=float, default=300.0, help="readiness wait, seconds")
    up.add_argument("--detach", action="store_true", help="leave them running; see `down`")
    sub.add_parser("down", help="stop replicas left by `up --detach`")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    layout = SglangLayout.default(args.dir)
    commands = {"install": _install, "model": _model, "up": _up, "down": _down}
    try:
        return commands[args.command](args, layout)
    except (InstallError, SglangStartError) as exc:
        _say(str(exc))
        return 1
