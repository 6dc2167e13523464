"""deploy/Dockerfile, read statically (Docker does not run on this machine).

The image cannot be built here; these checks hold the file to the repository: its first
stage builds kvgate's wheel from every package pyproject.toml installs (the same `pip wheel`
as `make wheel`, which tests/test_wheel.py runs and installs), the next installs that wheel
pinned by constraints.txt without the sources or a compiler, the image runs as a non-root
user, health-checks /health on kvgate's port, and its build context filter keeps what it
copies.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def test_base_is_slim_python_311() -> None:
    args = dict(rest.split("=", 1) for kw, rest in instructions() if kw == "ARG" and "=" in rest)
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", args["PYTHON_IMAGE"])
    assert all(rest.startswith("${PYTHON_IMAGE}") for kw, rest in instructions() if kw == "FROM")


def test_installs_every_package_with_constraints() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    wheel, install, _ = stages()
    # COPY SRC... DEST: every source, trailing slash dropped
    copied = {src.rstrip("/") for kw, rest in wheel if kw == "COPY" for src in rest.split()[:-1]}
    assert packages <= copied
    build_files = {"pyproject.toml", "setup.py", "MANIFEST.in", "build-constraints.txt"}
    assert build_files | {"README.md", "deploy/envoy/envoy.yaml"} <= copied
    for name in packages | build_files:
        assert (ROOT / name).exists(), name
    assert (ROOT / "bench" / "envoy.yaml").resolve() == ROOT / "deploy" / "envoy" / "envoy.yaml"
    runs = " ".join(rest for kw, rest in wheel if kw == "RUN")
    # the native core is compiled here, into the wheel, with pip and setuptools pinned
    assert "gcc" in runs and "pip install -c build-constraints.txt pip" in runs
    assert "pip wheel --no-deps --build-constraint build-constraints.txt" in runs
    # the install stage has no sources and no compiler: the wheel, its pins, its extras
    assert not [rest for kw, rest in install if kw == "COPY" and "router" in rest]
    runs = " ".join(rest for kw, rest in install if kw == "RUN")
    assert "gcc" not in runs
    assert "-c /tmp/pins/constraints.txt" in runs and "kvgate-*.whl)[otel,epp]" in runs
    assert "kvgate.index._native" in runs and "kvgate epp --help" in runs


def test_runtime_runs_unprivileged_with_healthcheck() -> None:
    runtime = stages()[-1]
    (user,) = [rest for kw, rest in runtime if kw == "USER"]
    assert user.split(":")[0] not in {"0", "root"}
    (healthcheck,) = [rest for kw, rest in runtime if kw == "HEALTHCHECK"]
    assert "/health" in healthcheck
    assert "KVGATE_PORT" in healthcheck
    env = " ".join(rest for kw, rest in runtime if kw == "ENV")
    assert "KVGATE_PORT=8000" in env
    assert "KVGATE_HOST=0.0.0.0" in env  # a container must listen beyond its loopback
    (expose,) = [rest for kw, rest in runtime if kw == "EXPOSE"]
    assert expose == "8000"
    (entrypoint,) = [rest for kw, rest in runtime if kw == "ENTRYPOINT"]
    assert entrypoint == '["kvgate", "serve"]'
    # the image only carries the virtualenv from the build stage, not the sources
    assert [kw for kw, _ in runtime].count("COPY") == 1


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics (last match wins, ``!`` re-includes), enough for our file."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.rstrip("/")
        if (
            fnmatch.fnmatch(path, body)
            or path.startswith(body + "/")
            or fnmatch.fnmatch(path, body.replace("**/", "*/"))
        ):
            result = not negate
    return result


def test_build_context_keeps_sources_and_drops_venvs() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for kept in (
        "pyproject.toml",
        "MANIFEST.in",
        "constraints.txt",
        "router/app.py",
        "backends/discovery.py",
        "deploy/envoy/envoy.yaml",
    ):
        assert not ignored(kept, patterns), kept
    for dropped in (".venv/bin/python", ".engines/vllm-venv/bin/python", "tests/conftest.py"):
        assert ignored(dropped, patterns), dropped
