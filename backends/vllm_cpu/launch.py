"""Start, watch and stop vLLM CPU replicas on 127.0.0.1 (one process group each).

Each replica: ``python -m vllm.entrypoints.openai.api_server`` with prefix caching, block size
32, prompt token details and a ZMQ KV-event publisher with a replay socket, pinned to its own
core. vLLM 0.32.0 *binds* its PUB socket only for ``*``, ``::`` or ``ipc://`` endpoints and
*connects* for any other ``tcp://host:port``, so a loopback-only publisher is an ``ipc://``
socket; the replay ROUTER socket always binds, so it is ``tcp://127.0.0.1:PORT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx

from kvgate.backends.process import (
    LOOPBACK,
    ChildProcess,
    http_ready,
    port_free,
    wait_until,
)

EventsTransport = Literal["ipc", "tcp"]


class EngineStartError(RuntimeError):
    """A replica exited or did not become ready in time; the message carries its log tail."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Where one replica listens."""

    index: int
    http_port: int
    replay_port: int
    events_bind: str
    """The PUB endpoint handed to vLLM (``ipc://...`` or ``tcp://*:PORT``)."""

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        """Where a subscriber connects."""
        return self.events_bind.replace("tcp://*:", f"tcp://{LOOPBACK}:")

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.replay_port}"

    def worker_flag(self) -> str:
        """The value of kvgate's ``--worker`` flag for this replica."""
        return f"{self.url},events={self.events_endpoint},replay={self.replay_endpoint}"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """What every replica of a fleet shares."""

    python: Path
    model_dir: Path
    logs: Path
    served_model_name: str = "tiny"
    block_size: int = 32
    kv_cache_gib: int = 1
    max_model_len: int = 4096
    topic: str = "kv-events"
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()


def socket_dir(key: Path) -> Path:
    """A short per-checkout folder for ipc sockets (unix socket paths are capped at ~107 bytes)."""
    digest = hashlib.sha256(str(key.resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"kvgate-{os.getuid()}-{digest}"


def plan_replicas(
    count: int,
    port: int,
    events_port: int,
    run_dir: Path,
    transport: EventsTransport = "ipc",
) -> list[ReplicaSpec]:
    """Replica i: HTTP ``port+i``; events ``events_port+2i``; replay ``events_port+2i+1``."""
    specs = []
    for i in range(count):
        events_tcp = events_port + 2 * i
        bind = f"tcp://*:{events_tcp}" if transport == "tcp" else f"ipc://{run_dir}/r{i}.events"
        specs.append(ReplicaSpec(i, port + i, events_tcp + 1, bind))
    return specs


def engine_command(options: EngineOptions, spec: ReplicaSpec) -> list[str]:
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": spec.events_bind,
        "replay_endpoint": f"tcp://{LOOPBACK}:{spec.replay_port}",
        "topic": options.topic,
    }
    return [
        str(options.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(options.model_dir),
        "--served-model-name",
        options.served_model_name,
        "--host",
        LOOPBACK,
        "--port",
        str(spec.http_port),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--block-size",
        str(options.block_size),
        "--max-model-len",
        str(options.max_model_len),
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(events_config),
        *options.extra_args,
    ]


def _core_for(index: int) -> str:
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)])


def engine_env(options: EngineOptions, spec: ReplicaSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(options.kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=_core_for(spec.index),
        VLLM_HOST_IP=LOOPBACK,
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("VIRTUAL_ENV", None)
    env.update(dict(options.extra_env))
    return env


class Replica:
    """One vLLM server process group, its log file and its readiness."""

    def __init__(self, options: EngineOptions, spec: ReplicaSpec) -> None:
        self.options = options
        self.spec = spec
        self.log_path = options.logs / f"replica-{spec.index}.log"
        self._proc: ChildProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive()

    def start(self) -> None:
        if self.running:
            return
        for port in (self.spec.http_port, self.spec.replay_port):
            if not port_free(port):
                raise EngineStartError(f"replica {self.spec.index}: port {port} is in use")
        if self.spec.events_bind.startswith("ipc://"):
            Path(self.spec.events_bind.removeprefix("ipc://")).parent.mkdir(
                parents=True, exist_ok=True
            )
        self._proc = ChildProcess(
            engine_command(self.options, self.spec),
            name=f"replica {self.spec.index}",
            log_path=self.log_path,
            env=engine_env(self.options, self.spec),
            append_log=True,
        ).start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _failure(self, why: str) -> EngineStartError:
        return EngineStartError(
            f"replica {self.spec.index} ({self.spec.url}) {why}; log {self.log_path}:\n"
            + self.log_tail()
        )

    def check_ready(self, client: httpx.Client) -> bool:
        """One readiness probe; raises when the process has exited."""
        if self._proc is None:
            raise self._failure("was never started")
        code = self._proc.exit_code()
        if code is not None:
            raise self._failure(f"exited with code {code}")
        return http_ready(client, f"{self.spec.url}/health")

    def terminate(self) -> None:
        """Ask the process group to exit (SIGTERM) without waiting."""
        if self._proc is not None:
            self._proc.terminate()

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the process group: SIGTERM, SIGKILL after ``timeout``; reaps the leader."""
        if self._proc is None:
            return
        self._proc.stop(timeout)
        self._proc = None
        if self.spec.events_bind.startswith("ipc://"):  # vLLM leaves its socket file behind
            Path(self.spec.events_bind.removeprefix("ipc://")).unlink(missing_ok=True)


def wait_ready(replicas: Sequence[Replica], timeout: float, poll: float = 0.5) -> None:
    """Block until every replica answers ``/health`` 200; ``EngineStartError`` otherwise."""
    pending = list(replicas)

    def ready() -> bool:
        nonlocal pending
        pending = [r for r in pending if not r.check_ready(client)]
        return not pending

    with httpx.Client(timeout=2.0, trust_env=False) as client:
        try:
            wait_until(ready, timeout, "vLLM replicas", poll_s=poll)
        except TimeoutError as exc:
            raise pending[0]._failure(f"not ready after {timeout:.0f} s") from exc


class Fleet:
    """N replicas started together; a context manager that always stops what it started."""

    def __init__(self, options: EngineOptions, specs: Sequence[ReplicaSpec]) -> None:
        self.options = options
        self.replicas = [Replica(options, spec) for spec in specs]

    @property
    def urls(self) -> list[str]:
        return [r.spec.url for r in self.replicas]

    def worker_flags(self) -> list[str]:
        """``--worker`` values for kvgate, one per replica."""
        return [r.spec.worker_flag() for r in self.replicas]

    def start(self, ready_timeout: float = 300.0) -> None:
        try:
            for replica in self.replicas:
                replica.start()
            wait_ready(self.replicas, ready_timeout)
        except BaseException:
            self.stop()
            raise

    def restart(self, index: int, ready_timeout: float = 300.0) -> None:
        replica = self.replicas[index]
        replica.stop()
        replica.start()
        wait_ready([replica], ready_timeout)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.terminate()  # all at once, then wait for each
        for replica in self.replicas:
            replica.stop()

    def process_groups(self) -> list[int]:
        return [r.pid for r in self.replicas if r.pid is not None]

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def iter_state_groups(state_file: Path) -> Iterator[int]:
    """Process groups recorded by ``kvgate engines up --detach`` that still run vLLM."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return
    for pgid in state.get("process_groups", []):
        try:
            cmdline = Path(f"/proc/{int(pgid)}/cmdline").read_bytes()
        except OSError:
            continue
        if b"vllm.entrypoints" in cmdline:
            yield int(pgid)


def write_state(state_file: Path, fleet: Fleet) -> None:
    state = {"process_groups": fleet.process_groups(), "workers": fleet.worker_flags()}
    state_file.write_text(json.dumps(state, indent=2) + "\n")
