"""deploy/Dockerfile, read statically (Docker does not run on this machine).

The image cannot be built here; these checks hold the file to the repository: it copies
every package pyproject.toml installs, pins with constraints.txt, runs as a non-root user,
health-checks /health on kvgate's port, and its build context filter keeps what it copies.
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
    build = stages()[0]
    # COPY SRC... DEST: every source, trailing slash dropped
    copied = {src.rstrip("/") for kw, rest in build if kw == "COPY" for src in rest.split()[:-1]}
    assert packages <= copied
    build_files = {
        "pyproject.toml",
        "setup.py",
        "constraints.txt",
        "build-constraints.txt",
        "README.md",
    }
    assert build_files <= copied
    for name in packages | build_files:
        assert (ROOT / name).exists(), name
    runs = " ".join(rest for kw, rest in build if kw == "RUN")
    # pip and the build backend pinned too; tracing ready, off by default; kvgate epp ready
    assert "pip install -c build-constraints.txt pip" in runs
    assert "--build-constraint build-constraints.txt '.[otel,epp]'" in runs
    assert "kvgate epp --help" in runs
    # the index's native core is compiled in the build stage and checked to import there
    assert "gcc" in runs and "kvgate.index._native" in runs


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
    for kept in ("pyproject.toml", "constraints.txt", "router/app.py", "backends/discovery.py"):
        assert not ignored(kept, patterns), kept
    for dropped in (".venv/bin/python", ".engines/vllm-venv/bin/python", "tests/conftest.py"):
        assert ignored(dropped, patterns), dropped
