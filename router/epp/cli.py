"""``kvgate epp``: kvgate as the endpoint picker of an Envoy-based gateway (ext_proc).

It takes every option of ``kvgate serve`` (the same names, ``KVGATE_*`` variables and
``--config`` file: the fleet, index, scoring and queue) and ``--grpc-port``; ``--host`` /
``--port`` are its HTTP side's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import uvicorn

from kvgate.router.config import MOVED, ConfigError, load_settings
from kvgate.router.epp.config import EppSettings
from kvgate.router.flags import add_moved_flags, add_settings_flags, given_settings
from kvgate.router.gateway import is_loopback
from kvgate.router.logs import configure_logging
from kvgate.router.serve import supervise, uvicorn_config

log = logging.getLogger("kvgate")

_DESCRIPTION = """\
Run kvgate as the endpoint picker (EPP) of an Envoy-based gateway: Envoy asks it over the
ext_proc gRPC protocol (the Gateway API Inference Extension's Endpoint Picker Protocol) which
replica takes each request, then carries the bytes itself. kvgate picks as `kvgate serve`
does (keys, index, scoring, queue) and learns from each answer as Envoy passes it.

Settings come from (highest precedence first) these flags, KVGATE_* environment variables,
the --config YAML file (the one `kvgate serve` reads), and defaults. Needs the epp extra:
pip install 'kvgate[epp]'. Envoy configuration: deploy/envoy/ (docs/deploy.md).
"""

_EXAMPLES = """\
examples:
  kvgate epp --worker http://10.0.0.1:8000,events=tcp://10.0.0.1:5557 --grpc-port 9002
  kvgate epp --sim 4 --sim-port 9101   # 4 simulated replicas at 127.0.0.1:9101..9104
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate epp",
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
    add_settings_flags(parser, EppSettings, first)
    add_moved_flags(parser, EppSettings, MOVED)
    return parser


def run(settings: EppSettings) -> None:
    """Serve the HTTP and gRPC sides until interrupted."""
    try:
        from kvgate.router.epp.app import create_epp_app  # noqa: PLC0415 (the optional extra)
    except ImportError as exc:
        raise ConfigError(
            f"kvgate epp needs gRPC and Envoy's protos: pip install 'kvgate[epp]': {exc}"
        ) from exc
    app = create_epp_app(settings)
    if settings.admin_token is None and not is_loopback(settings.host):
        log.warning(
            "listening on %s without an admin token: /debug is disabled "
            "(set --admin-token or KVGATE_ADMIN_TOKEN to use it)",
            settings.host,
        )
    uvicorn.Server(uvicorn_config(app, settings)).run()


def port_clash(settings: EppSettings) -> str | None:
    """Why ``--grpc-port`` cannot be used beside the other ports (None: it can)."""
    port = settings.grpc_port
    if port == 0:
        return None
    if port == settings.port:
        return f"--grpc-port {port} is also --port"
    replicas = len(settings.sim_roles)
    sims = range(settings.sim_port, settings.sim_port + replicas)
    events = range(settings.sim_events_port, settings.sim_events_port + 2 * replicas)
    if port in sims or port in events:
        return (
            f"--grpc-port {port} is a port of the simulated replicas (--sim-port "
            f"{settings.sim_port}, --sim-events-port {settings.sim_events_port}): move one"
        )
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = given_settings(args, EppSettings)
    try:
        settings = load_settings(args.config, overrides, model=EppSettings)
    except ConfigError as exc:
        print(f"kvgate epp: {exc}", file=sys.stderr)
        return 2
    clash = port_clash(settings)
    if clash is not None:
        print(f"kvgate epp: {clash}", file=sys.stderr)
        return 2
    with configure_logging(settings.log_level, settings.log_format):
        return supervise(settings, args.config, overrides, runner=run, command="kvgate epp")
