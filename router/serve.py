"""``kvgate serve``: parse flags, build the settings, run the gateway under uvicorn.

``--sim N`` first starts N simulated replicas (``kvgate sim`` in a subprocess), waits for
them to answer ``/health``, routes to them with their KV events wired, and stops them on exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from router.app import create_app
from router.config import ConfigError, Settings, load_settings
from router.flags import add_settings_flags, given_settings
from router.gateway import Gateway, is_loopback
from router.simfleet import SimFleet, SimFleetError

log = logging.getLogger("kvgate")

_DESCRIPTION = """\
Run the kvgate gateway: an OpenAI-compatible router in front of vLLM / SGLang replicas.

Settings come from (highest precedence first) these flags, KVGATE_* environment variables
(nested with __, e.g. KVGATE_HEALTH__INTERVAL_S=1), the --config YAML file, and defaults.
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
    parser.add_argument("--config", metavar="FILE", help="YAML settings file")
    add_settings_flags(parser, Settings)
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for chatty in ("httpx", "httpcore"):  # one line per health probe otherwise
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))


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
        "access_log": False,
        "log_level": settings.log_level,
        "server_header": False,
        "proxy_headers": False,  # kvgate is the front door: the client address is the peer
        # SIGTERM: stop accepting, let in-flight streams finish, then cut them (docs/scaling.md)
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
    }
    return uvicorn.Config(app, **{**options, **overrides})


def run(settings: Settings) -> None:
    """Serve until interrupted."""
    app = create_app(settings)
    if settings.admin_token is None and not is_loopback(settings.host):
        log.warning(
            "listening on %s without an admin token: /admin and /debug are disabled "
            "(set --admin-token or KVGATE_ADMIN_TOKEN to use them)",
            settings.host,
        )
    uvicorn.Server(uvicorn_config(app, settings)).run()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = given_settings(args, Settings)
    try:
        settings = load_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    _configure_logging(settings.log_level)
    if not settings.sim:
        if not settings.workers:
            log.warning("no --worker given: add workers with POST /admin/workers")
        run(settings)
        return 0
    # uvicorn drains on SIGTERM, then raises the signal again with the handler it found: ours
    # unwinds through the ``with`` (stopping the simulated fleet) instead of killing the process
    # with its subprocess left running.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with SimFleet(
            settings.sim, base_port=settings.sim_port, events_port=settings.sim_events_port
        ) as fleet:
            settings = load_settings(args.config, fleet.settings_overrides(overrides))
            log.info("routing to %d simulated replicas", settings.sim)
            run(settings)
    except SimFleetError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        log.info("terminated; simulated replicas stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Terminated(Exception):
    """SIGTERM arrived outside uvicorn's own handling (or after its graceful shutdown)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated
