"""Start, watch and stop SGLang CPU replicas on 127.0.0.1 (one process group each).

Each replica: ``python -m sglang.launch_server`` on the CPU engine (``SGLANG_USE_CPU_ENGINE=1``,
torch-native attention and sampling, its scheduler sleeping while idle), with the radix
prefix cache, ``cached_tokens`` reports,
Prometheus metrics and a ZMQ KV-event publisher plus replay socket, its compute threads pinned
to one core (``SGLANG_CPU_OMP_THREADS_BIND``). SGLang *connects* its PUB socket to a
``tcp://host:port`` endpoint unless the config says ``"bind": true`` (``tcp://*`` would bind
every interface), so each replica binds ``tcp://127.0.0.1`` ports of its own; its
torch.distributed port (``--nccl-port``) is fixed too, so that replicas never collide.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from kvgate.backends.process import LOOPBACK, ChildProcess, http_ready, port_free, wait_until
from kvgate.backends.sglang_cpu.install import CPU_ENGINE_ENV

READY_PATH = "/ready"
"""SGLang's cheap readiness answer: 200 once started (warm-up done) and healthy."""


class SglangStartError(RuntimeError):
    """A replica exited or did not become ready in time; the message carries its log tail."""


@dataclass(frozen=True, slots=True)
class SglangReplicaSpec:
    """Where one replica listens (every port on 127.0.0.1)."""

    index: int
    http_port: int
    events_port: int
    replay_port: int
    nccl_port: int

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.replay_port}"

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.http_port, self.events_port, self.replay_port, self.nccl_port)

    def worker_flag(self) -> str:
        """The value of kvgate's ``--worker`` flag for this replica."""
        return (
            f"{self.url},engine=sglang,events={self.events_endpoint},replay={self.replay_endpoint}"
        )


@dataclass(frozen=True, slots=True)
class SglangOptions:
    """What every replica of a fleet shares."""

    python: Path
    model_dir: Path
    logs: Path
    served_model_name: str = "tiny"
    page_size: int = 32
    max_total_tokens: int = 40960
    topic: str = "kv-events"
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    dp_size: int = 1
    """Data-parallel ranks (``--dp-size``): rank r publishes on the events and replay ports
    + r, one core each; SGLang then picks its own torch.distributed port (no ``--nccl-port``,
    which its data-parallel controller would hand to both ranks)."""


def plan_replicas(count: int, port: int, events_port: int) -> list[SglangReplicaSpec]:
    """Replica i: HTTP ``port+i``; events ``events_port+3i``, replay ``+1``, nccl ``+2``."""
    specs = []
    for i in range(count):
        base = events_port + 3 * i
        specs.append(SglangReplicaSpec(i, port + i, base, base + 1, base + 2))
    return specs


def events_config(options: SglangOptions, spec: SglangReplicaSpec) -> dict[str, object]:
    """The ``--kv-events-config`` of a replica: bound loopback publisher and replay socket."""
    return {
        "publisher": "zmq",
        "endpoint": spec.events_endpoint,
        "bind": True,
        "topic": options.topic,
        "replay_endpoint": spec.replay_endpoint,
    }


def engine_command(options: SglangOptions, spec: SglangReplicaSpec) -> list[str]:
    if options.dp_size > 1:
        command = _command(options, spec)
        at = command.index("--nccl-port")
        return [*command[:at], *command[at + 2 :], "--dp-size", str(options.dp_size)]
    return _command(options, spec)


def _command(options: SglangOptions, spec: SglangReplicaSpec) -> list[str]:
    return [
        str(options.python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(options.model_dir),
        "--served-model-name",
        options.served_model_name,
        "--host",
        LOOPBACK,
        "--port",
        str(spec.http_port),
        "--nccl-port",
        str(spec.nccl_port),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-overlap-schedule",
        "--sleep-on-idle",  # idle, its scheduler busy-polls: ~0.7 of a core without this
        "--page-size",
        str(options.page_size),
        "--max-total-tokens",
        str(options.max_total_tokens),
        "--enable-cache-report",
        "--enable-metrics",
        "--kv-events-config",
        json.dumps(events_config(options, spec)),
        *options.extra_args,
    ]


def _core_for(index: int, ranks: int = 1) -> str:
    """The core(s) of a replica: one per rank, ``|``-separated (SGLang's rank binding)."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[(index + r) % len(cores)]) for r in range(ranks))


def engine_env(options: SglangOptions, spec: SglangReplicaSpec) -> dict[str, str]:
    env = dict(os.environ)
    env[CPU_ENGINE_ENV[0]] = CPU_ENGINE_ENV[1]
    env.update(
        SGLANG_CPU_OMP_THREADS_BIND=_core_for(spec.index, options.dp_size),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("VIRTUAL_ENV", None)
    env.update(dict(options.extra_env))
    return env


class SglangReplica:
    """One SGLang server process group (server, scheduler, detokenizer), its log and its
    readiness."""

    def __init__(self, options: SglangOptions, spec: SglangReplicaSpec) -> None:
        self.options = options
        self.spec = spec
        self.log_path = options.logs / f"sglang-replica-{spec.index}.log"
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
        for port in self.spec.ports:
            if not port_free(port):
                raise SglangStartError(f"SGLang replica {self.spec.index}: port {port} is in use")
        self._proc = ChildProcess(
            engine_command(self.options, self.spec),
            name=f"SGLang replica {self.spec.index}",
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

    def failure(self, why: str) -> SglangStartError:
        return SglangStartError(
            f"SGLang replica {self.spec.index} ({self.spec.url}) {why}; log {self.log_path}:\n"
            + self.log_tail()
        )

    def check_ready(self, client: httpx.Client) -> bool:
        """One readiness probe; raises when the process has exited."""
        if self._proc is None:
            raise self.failure("was never started")
        code = self._proc.exit_code()
        if code is not None:
            raise self.failure(f"exited with code {code}")
        return http_ready(client, f"{self.spec.url}{READY_PATH}")

    def terminate(self) -> None:
        """Ask the process group to exit (SIGTERM) without waiting."""
        if self._proc is not None:
            self._proc.terminate()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL after ``timeout``; reaps the leader."""
        if self._proc is None:
            return
        self._proc.stop(timeout)
        self._proc = None


def wait_ready(replicas: Sequence[SglangReplica], timeout: float, poll: float = 0.5) -> None:
    """Block until every replica answers ``/ready`` 200; ``SglangStartError`` otherwise."""
    pending = list(replicas)

    def ready() -> bool:
        nonlocal pending
        pending = [r for r in pending if not r.check_ready(client)]
        return not pending

    with httpx.Client(timeout=2.0, trust_env=False) as client:
        try:
            wait_until(ready, timeout, "SGLang replicas", poll_s=poll)
        except TimeoutError as exc:
            raise pending[0].failure(f"not ready after {timeout:.0f} s") from exc


class SglangFleet:
    """N replicas started together; a context manager that always stops what it started."""

    def __init__(self, options: SglangOptions, specs: Sequence[SglangReplicaSpec]) -> None:
        self.options = options
        self.replicas = [SglangReplica(options, spec) for spec in specs]

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

    def __enter__(self) -> SglangFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def iter_state_groups(state_file: Path) -> Iterator[int]:
    """Process groups recorded by ``up --detach`` that still run SGLang."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return
    for pgid in state.get("process_groups", []):
        try:
            cmdline = Path(f"/proc/{int(pgid)}/cmdline").read_bytes()
        except OSError:
            continue
        if b"sglang.launch_server" in cmdline:
            yield int(pgid)


def write_state(state_file: Path, fleet: SglangFleet) -> None:
    state = {"process_groups": fleet.process_groups(), "workers": fleet.worker_flags()}
    state_file.write_text(json.dumps(state, indent=2) + "\n")
