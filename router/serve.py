"""``kvgate serve``: parse flags, build the settings, run the gateway under uvicorn.

``--sim N`` first starts N simulated replicas (``kvgate sim`` in a subprocess), waits for
them to answer ``/health``, routes to them with their KV events wired, and stops them on exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvgate.router.app import create_app
from kvgate.router.config import MOVED, ConfigError, S, Settings, load_settings
from kvgate.router.flags import add_moved_flags, add_settings_flags, given_settings
from kvgate.router.gateway import Gateway, is_loopback
from kvgate.router.logs import configure_logging
from kvgate.router.simfleet import SimFleet, SimFleetError
from kvgate.scheduling.config import Tuning

log = logging.getLogger("kvgate")

_DESCRIPTION = """\
Run the kvgate gateway: an OpenAI-compatible router in front of vLLM / SGLang replicas.

Settings come from (highest precedence first) these flags, KVGATE_* environment variables
(nested with __, e.g. KVGATE_HEALTH__INTERVAL_S=1), the --config YAML file, and defaults.
The options most users need come first; --help-all also lists the settings read only from
the config file and the environment.
"""

_EXAMPLES = """\
examples:
  kvgate serve --worker http://127.0.0.1:9001 --worker http://127.0.0.1:9002
  kvgate serve --worker http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
  kvgate serve --sim 4                 # 4 simulated replicas, cache-aware routing
  kvgate serve --config kvgate.yaml --policy least_loaded
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate serve",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    first = parser.add_argument_group()
    first.add_argument(
        "--config",
        metavar="FILE",
        help="YAML settings file: every setting, those without a flag too (--help-all)",
    )
    add_settings_flags(parser, Settings, first)
    add_moved_flags(parser, Settings, MOVED)
    return parser


def uvicorn_config(app: FastAPI, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The listener of ``kvgate serve``: uvloop, httptools with kvgate's connection limits
    (``router.listener``), no proxy headers; ``overrides`` replace any option (tests)."""
    gateway: Gateway = app.state.gateway
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "http": gateway.listener.protocol(),
        "ws": "none",
        "lifespan": "on",
        "access_log": False,  # kvgate writes its own (router/accesslog.py)
        "log_config": None,  # uvicorn's loggers go to kvgate's handler (router/logs.py)
        "log_level": settings.log_level,
        "server_header": False,
        "proxy_headers": False,  # kvgate is the front door: the client address is the peer
        # SIGTERM: stop accepting, let in-flight streams finish, then cut them (docs/scaling.md)
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
    }
    return uvicorn.Config(app, **{**options, **overrides})


def run(settings: Settings, tuning: Tuning | None = None) -> None:
    """Serve until interrupted (``tuning``: the scheduler's internal constants, benchmarks)."""
    app = create_app(settings, tuning=tuning)
    if settings.admin_token is None and not is_loopback(settings.host):
        log.warning(
            "listening on %s without an admin token: /admin and /debug are disabled "
            "(set --admin-token or KVGATE_ADMIN_TOKEN to use them)",
            settings.host,
        )
    uvicorn.Server(uvicorn_config(app, settings)).run()


def main(argv: list[str], *, tuning: Tuning | None = None) -> int:
    """``kvgate serve``; ``tuning``: the scheduler's internal constants (benchmarks build a
    variant through ``bench.variants``, never a user)."""
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = given_settings(args, Settings)
    try:
        settings = load_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    problems = settings.index.tokenizer_problems()
    if problems:
        print("kvgate serve: invalid configuration:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    with configure_logging(settings.log_level, settings.log_format):
        return supervise(settings, args.config, overrides, runner=lambda ready: run(ready, tuning))


def supervise(
    settings: S,
    config: str | None,
    overrides: dict[str, Any],
    *,
    runner: Callable[[S], None] | None = None,
    command: str = "kvgate serve",
) -> int:
    """Run ``runner`` (default: the gateway) with ``settings`` until interrupted; with
    ``--sim N``, the simulated replicas first (the settings rebuilt, as the same type, with
    them as workers), stopped on the way out. The process's exit code."""
    go: Callable[[S], None] = runner if runner is not None else run
    # uvicorn drains on SIGTERM, then raises the signal again with the handler it found: ours
    # unwinds (stopping the simulated fleet, writing the queued log lines) instead of killing
    # the process with its subprocess left running and its last lines lost.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if not settings.sim:
            if not settings.workers:
                log.warning("no --worker given: add workers with POST /admin/workers")
            go(settings)
            return 0
        with SimFleet(
            len(settings.sim_roles),
            base_port=settings.sim_port,
            events_port=settings.sim_events_port,
            roles=settings.sim_roles,
        ) as fleet:
            overrides = fleet.settings_overrides(overrides)
            settings = load_settings(config, overrides, model=type(settings))
            log.info("routing to %s simulated replicas", settings.sim)
            go(settings)
    except ConfigError as exc:  # found while building the gateway (e.g. tracing's extra)
        log.error("%s: %s", command, exc)
        return 2
    except SimFleetError as exc:
        log.error("%s: %s", command, exc)
        return 1
    except _Terminated:
        log.info("terminated")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(Exception):
    """SIGTERM arrived outside uvicorn's own handling (or after its graceful shutdown)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated
