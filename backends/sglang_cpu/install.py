"""Install a pinned SGLang into its own venv (``.engines/sglang-venv``), reused when complete.

SGLang's declared dependencies include CUDA-only packages, so the install is in steps: torch
and torchvision (the CPU-usable pair on this machine's index), then ``--no-deps sglang``, then
the dependencies its CPU engine imports (``RUNTIME_REQUIREMENTS``), then our pure-torch
``sgl_kernel`` stand-in (``sgl_kernel_standin.py``) into the venv's site-packages. Every
package is pinned by ``constraints-sglang.txt`` (written from a working install with
``kvgate engines --engine sglang install --lock``), so CI resolves the same versions. The venv
is complete when its stamp records the same pins, constraints and stand-in as this checkout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.vllm_cpu.install import InstallReport, Log, base_python, run_logged

SGLANG_VERSION = "0.5.23"
TORCH_REQUIREMENTS: tuple[str, ...] = ("torch==2.14.1", "torchvision==0.29.1")
"""The torch SGLang 0.5.23 is built against, and the torchvision it imports (vLLM's torch
2.13.0 lacks a torchvision that imports here)."""

RUNTIME_REQUIREMENTS: tuple[str, ...] = (
    "aiohttp",
    "compressed-tensors==0.18.0",
    "dill",
    "distro",
    "einops",
    "fastapi",
    "gguf",
    "ipython",
    "jsonschema",
    "msgspec",
    "numpy",
    "openai==2.8.0",
    "orjson",
    "packaging",
    "partial-json-parser",
    "pillow",
    "prometheus-client>=0.20.0",
    "psutil",
    "pybase64",
    "pydantic",
    "python-multipart",
    "pyzmq>=25.1.2",
    "regex",
    "requests",
    "scipy",
    "sentencepiece==0.2.1",
    "setproctitle",
    "soundfile==0.13.1",
    "tiktoken",
    "tokenizers==0.23.2",
    "tqdm",
    "transformers==5.19.0",
    "uvicorn>=0.51",
    "uvloop",
    "watchfiles",
    "xgrammar==0.2.7",
    "xxhash",
    "zstandard",
)
"""SGLang's dependencies that its CPU engine imports to serve a dense model (the server,
scheduler, detokenizer, OpenAI endpoints, KV events, metrics); versions as SGLang pins them."""

CONSTRAINTS_FILE = Path(__file__).with_name("constraints-sglang.txt")
STANDIN_FILE = Path(__file__).with_name("sgl_kernel_standin.py")
CPU_ENGINE_ENV = ("SGLANG_USE_CPU_ENGINE", "1")
_IMPORT_CHECK = (
    "import sglang, sgl_kernel, sglang.srt.entrypoints.http_server, "
    "sglang.srt.managers.scheduler, sglang.srt.models.llama; print(sglang.__version__)"
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "none"


def _wanted_stamp(constraints: Path) -> dict[str, str]:
    return {
        "sglang": SGLANG_VERSION,
        "torch": TORCH_REQUIREMENTS[0].partition("==")[2],
        "constraints_sha256": _digest(constraints),
        "standin_sha256": _digest(STANDIN_FILE),
    }


def is_installed(layout: SglangLayout, constraints: Path = CONSTRAINTS_FILE) -> bool:
    """True when the venv exists and was completed with the current pins and stand-in."""
    if not layout.python.is_file() or not layout.install_stamp.is_file():
        return False
    try:
        stamp = json.loads(layout.install_stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp == _wanted_stamp(constraints))


def _pip(layout: SglangLayout) -> list[str | Path]:
    return [layout.python, "-m", "pip", "--disable-pip-version-check"]


def _site_packages(layout: SglangLayout) -> Path:
    done = subprocess.run(
        [str(layout.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(done.stdout.strip())


def install_standin(layout: SglangLayout) -> Path:
    """Copy the ``sgl_kernel`` stand-in into the venv as a package; returns its path."""
    package = _site_packages(layout) / "sgl_kernel"
    package.mkdir(exist_ok=True)
    target = package / "__init__.py"
    shutil.copyfile(STANDIN_FILE, target)
    return target


def ensure_installed(
    layout: SglangLayout,
    log: Log,
    *,
    constraints: Path = CONSTRAINTS_FILE,
    force: bool = False,
    lock: bool = False,
) -> InstallReport:
    """Create (or reuse) the SGLang venv; raises ``InstallError`` naming the failed step.

    ``lock`` (or a missing constraints file) resolves freely and writes the resolved set to
    ``constraints``; otherwise every step is pinned by it."""
    if not force and not lock and is_installed(layout, constraints):
        return InstallReport(layout.python, reused=True, seconds=0.0)
    started = time.monotonic()
    layout.logs.mkdir(parents=True, exist_ok=True)
    log_path = layout.install_log
    log_path.write_text("")
    if layout.venv.exists():
        log(f"removing the existing venv {layout.venv}")
        shutil.rmtree(layout.venv)
    log(f"creating venv {layout.venv} (log: {log_path})")
    run_logged("venv", [base_python(), "-m", "venv", layout.venv], log_path)
    lock = lock or not constraints.is_file()
    pinned = [] if lock else ["-c", str(constraints)]
    pip = _pip(layout)
    run_logged("pip upgrade", [*pip, "install", "--quiet", *pinned, "pip"], log_path)
    log(f"installing {' '.join(TORCH_REQUIREMENTS)}")
    run_logged("torch", [*pip, "install", *pinned, *TORCH_REQUIREMENTS], log_path)
    log(f"installing sglang=={SGLANG_VERSION} (--no-deps) and its CPU dependencies")
    sglang = f"sglang=={SGLANG_VERSION}"
    run_logged("sglang", [*pip, "install", "--no-deps", *pinned, sglang], log_path)
    run_logged("sglang deps", [*pip, "install", *pinned, *RUNTIME_REQUIREMENTS], log_path)
    install_standin(layout)
    if lock:
        count = write_constraints(layout, constraints)
        log(f"pinned {count} packages in {constraints}")
    check: list[str | Path] = ["env", "=".join(CPU_ENGINE_ENV), layout.python, "-c", _IMPORT_CHECK]
    run_logged("import check", check, log_path)
    layout.install_stamp.write_text(json.dumps(_wanted_stamp(constraints)))
    return InstallReport(layout.python, reused=False, seconds=time.monotonic() - started)


def write_constraints(layout: SglangLayout, constraints: Path = CONSTRAINTS_FILE) -> int:
    """Pin every package of the venv (``pip freeze --all``) into ``constraints``."""
    frozen = subprocess.run(
        [*(str(p) for p in _pip(layout)), "freeze", "--all"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    pins = sorted((line for line in frozen if "==" in line), key=str.lower)
    header = [
        "# Every package of .engines/sglang-venv, pinned "
        "(`kvgate engines --engine sglang install --lock`).",
        f"# sglang {SGLANG_VERSION} is installed with --no-deps; sgl_kernel is our stand-in.",
    ]
    constraints.write_text("\n".join([*header, *pins]) + "\n")
    return len(pins)
