"""``kvgate`` command line: a thin dispatcher to each sub-command's own ``main(argv)``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

# sub-command -> (module exposing ``main(argv: list[str]) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "kvgate.router.serve",
        "run the gateway (`kvgate serve --sim 4` for the embedded demo)",
    ),
    "epp": ("kvgate.router.epp.cli", "be the endpoint picker of an Envoy gateway (ext_proc gRPC)"),
    "sim": ("kvgate.backends.sim.cli", "run a simulated vLLM-like engine fleet"),
    "bench": ("kvgate.bench.cli", "benchmarks: trace replay across routers and policies"),
    "engines": (
        "kvgate.backends.engines_cli",
        "install and run real vLLM or SGLang CPU replicas with a tiny model",
    ),
}


def version() -> str:
    """The installed kvgate's version ("unknown" when run from a tree never installed)."""
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"


def _usage() -> str:
    lines = ["usage: kvgate [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n`kvgate COMMAND --help` documents each command.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0 if args else 2
    if args[0] in {"-V", "--version"}:
        print(f"kvgate {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvgate: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    code: int = module.main(rest)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
