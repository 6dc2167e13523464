"""The native core under AddressSanitizer and UndefinedBehaviorSanitizer.

The core is compiled again with ``-fsanitize=address,undefined`` into a copy of the ``index``
package, and the native test suites run against that copy in a subprocess: an out-of-bounds
access, a use after free or undefined behaviour anywhere they reach aborts the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITES = [
    "test_native_core.py",
    "test_native_ingest.py",
    "test_index_suite.py",
    "test_events_hostile.py",  # crafted streams in child processes: they inherit the copy
    "test_ingest_fuzz.py",  # seeded fuzz of both paths, shorter (KVGATE_FUZZ_SECONDS below)
]

pytestmark = pytest.mark.slow


def _runtime(name: str) -> str | None:
    """The sanitizer runtime's path from gcc, or None when gcc does not have it."""
    compiler = shutil.which("gcc")
    if compiler is None:
        return None
    found = subprocess.run(
        [compiler, f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return found if Path(found).is_absolute() and Path(found).exists() else None


def test_native_suites_pass_under_address_and_ub_sanitizers(tmp_path: Path) -> None:
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("gcc's sanitizer runtimes are not installed")
    package = tmp_path / "index"
    shutil.copytree(ROOT / "index", package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(
        [
            "gcc",
            "-O1",
            "-g",
            "-std=c11",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer",
            "-fPIC",
            "-shared",
            f"-I{sysconfig.get_paths()['include']}",
            *sorted(str(source) for source in (package / "csrc").glob("*.c")),
            "-o",
            str(package / f"_native{suffix}"),
        ],
        check=True,
        timeout=120,
    )
    env = {
        **os.environ,
        "LD_PRELOAD": f"{asan}:{ubsan}",
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "PYTHONPATH": str(tmp_path),
        "KVGATE_FUZZ_SECONDS": "15",
    }

    def python(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """This interpreter, on the sanitized copy of the package."""
        return subprocess.run(
            [sys.executable, *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    loaded = python("-c", "import index._native as n; print(n.__file__)", timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip().startswith(str(tmp_path)), loaded.stdout
    suites = [str(ROOT / "tests" / name) for name in SUITES]
    run = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *suites, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
