"""kvgate as a user gets it: ``make wheel`` (an sdist, a wheel compiled from that sdist,
auditwheel's manylinux tag) installed into a fresh venv outside the checkout. The wheel
claims one top-level name (``kvgate``), carries the files its commands read, answers
``kvgate --version``, and ``kvgate serve --sim 2`` from it answers a chat completion over
real HTTP on 127.0.0.1; its working folders land in the user's cache, never in
site-packages. Marked ``wheel`` (a minute or two: a compile and a venv install);
``make test-fast`` leaves it out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvgate.backends.process import ChildProcess, free_port_range, wait_http

pytestmark = [pytest.mark.wheel, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "index", "scoring", "scheduling", "backends", "bench")
BUILD_TIMEOUT_S = 600
START_TIMEOUT_S = 90


@dataclass(frozen=True)
class Installed:
    dist: Path
    venv: Path
    home: Path  # the user's home and cache, outside the checkout

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PYTHON"))}
        keep.pop("VIRTUAL_ENV", None)
        return {**keep, "HOME": str(self.home), "XDG_CACHE_HOME": str(self.home / "cache")}

    def run(self, *argv: str, timeout_s: float = 120) -> str:
        done = subprocess.run(
            argv,
            cwd=self.home,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
        return done.stdout


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    _run(["make", "--no-print-directory", "wheel", f"DIST={dist}"], ROOT)
    (wheel,) = dist.glob("kvgate-*.whl")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], base)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    _run([*pip, "-c", str(ROOT / "build-constraints.txt"), "pip"], base)
    _run([*pip, "-c", str(ROOT / "constraints.txt"), f"{wheel}[bench]"], base)
    home = base / "home"
    home.mkdir()
    yield Installed(dist, venv, home)


def test_sdist_holds_the_packages_as_real_files(installed: Installed) -> None:
    """The ``kvgate/<pkg>`` links of the checkout become real folders in the sdist."""
    (sdist,) = installed.dist.glob("kvgate-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
    assert not [m.name for m in members if m.issym() or m.islnk()]
    names = {m.name.split("/", 1)[1] for m in members if "/" in m.name}
    for package in PACKAGES:
        assert f"kvgate/{package}/__init__.py" in names
    assert {"setup.py", "pyproject.toml", "index/csrc/module.c"} <= names


def test_wheel_is_manylinux_and_claims_only_kvgate(installed: Installed) -> None:
    (wheel,) = installed.dist.glob("kvgate-*.whl")
    assert "-manylinux_" in wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert top == {"kvgate"}
    (top_level,) = (n for n in names if n.endswith(".dist-info/top_level.txt"))
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(top_level).decode().split() == ["kvgate"]
    # what the commands read at run time ships with them
    for data in (
        "kvgate/backends/vllm_cpu/constraints-vllm.txt",
        "kvgate/backends/sglang_cpu/constraints-sglang.txt",
        "kvgate/bench/constraints-smg.txt",
        "kvgate/bench/constraints-dynamo.txt",
        "kvgate/bench/envoy.yaml",
        "kvgate/index/_native.pyi",
    ):
        assert data in names


def test_installed_names_and_version(installed: Installed) -> None:
    assert installed.run(str(installed.bin / "kvgate"), "--version").strip() == "kvgate 0.1.0"
    probe = (
        "import importlib.util as u, json, sys\n"
        "from kvgate.backends.vllm_cpu import install\n"
        "from kvgate.backends.sglang_cpu import install as sg\n"
        "from kvgate.backends.vllm_cpu.layout import EngineLayout\n"
        "from kvgate.bench import envoy, results\n"
        "import kvgate.index._native\n"
        "print(json.dumps({\n"
        " 'bare': [n for n in sys.argv[1:] if u.find_spec(n) is not None],\n"
        " 'engines': str(EngineLayout.default().root),\n"
        " 'results': str(results.results_dir()),\n"
        " 'data': [p.is_file() for p in (install.CONSTRAINTS_FILE, sg.CONSTRAINTS_FILE,\n"
        "          envoy.BOOTSTRAP)],\n"
        "}))\n"
    )
    found = json.loads(installed.run(str(installed.bin / "python"), "-c", probe, *PACKAGES))
    assert found["bare"] == []  # no generic top-level module from kvgate
    cache = installed.home / "cache" / "kvgate"
    assert found["engines"] == str(cache / "engines")
    assert found["results"] == str(cache / "bench-results")
    assert found["data"] == [True, True, True]


def test_engines_and_bench_take_their_folders_outside_site_packages(installed: Installed) -> None:
    """``kvgate engines down --dir`` and the default both act on folders of the user's;
    nothing is written under the venv."""
    before = {p for p in installed.venv.rglob("*") if p.is_file()}
    out = installed.run(str(installed.bin / "kvgate"), "engines", "--help")
    assert "--dir" in out
    installed.run(str(installed.bin / "kvgate"), "engines", "down")
    elsewhere = installed.home / "engines-here"
    installed.run(str(installed.bin / "kvgate"), "engines", "--dir", str(elsewhere), "down")
    installed.run(str(installed.bin / "kvgate"), "bench", "--help")
    after = {p for p in installed.venv.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert after - before == set()


def test_serve_sim_from_the_wheel_answers_a_chat_completion(installed: Installed) -> None:
    port = free_port_range(1, start=32500)
    sim_port = free_port_range(2, start=port + 1)
    events = free_port_range(4, start=sim_port + 2)
    argv = [
        str(installed.bin / "kvgate"), "serve", "--sim", "2", "--port", str(port),
        "--sim-port", str(sim_port), "--sim-events-port", str(events),
    ]  # fmt: skip
    log = installed.home / "serve.log"
    serve = ChildProcess(
        argv, name="kvgate serve (wheel)", log_path=log, env=installed.env(), cwd=installed.home
    ).start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready", START_TIMEOUT_S, serve)
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
            models = client.get("/v1/models").json()["data"]
            body = {
                "model": models[0]["id"],
                "messages": [{"role": "user", "content": "hello from an installed wheel"}],
                "max_tokens": 4,
            }
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
            metrics = client.get("/metrics").text
        info = next(line for line in metrics.splitlines() if line.startswith("kvgate_build_info{"))
        assert 'version="0.1.0"' in info
        # the bench, installed from the wheel, replays against it into the user's cache
        installed.run(
            str(installed.bin / "kvgate"), "bench", "replay", "--trace", "synthetic",
            "--syn-sessions", "2", "--syn-turns", "2", "--target", url, "--replicas", "2",
            "--model", models[0]["id"], "--no-progress", timeout_s=180,
        )  # fmt: skip
        results = installed.home / "cache" / "kvgate" / "bench-results"
        assert [p.name for p in results.iterdir() if p.name.startswith("replay-")]
    finally:
        serve.stop()
    assert not serve.alive()
