"""Processes a benchmark starts on 127.0.0.1: the simulated fleet and the router under test.

Every process gets its own log file and process group, and is stopped by its pid (SIGTERM,
then SIGKILL: ``backends.process``).
CPU use is read from /proc/<pid>/stat (utime + stime of the process and its live
descendants, plus what exited children left in cutime/cstime), so no psutil is needed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from kvgate.backends.process import LOOPBACK, ChildProcess, free_port_range, wait_http, wait_until
from kvgate.backends.sim import cli as sim_cli
from kvgate.backends.sim.config import SimConfig
from kvgate.backends.sim.tokenizer import tokenizer_dir

CLK_TCK = os.sysconf("SC_CLK_TCK")
SIM_MODEL = "kvgate-sim"


# --- CPU accounting -----------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) is in parentheses and may contain spaces
    return raw[raw.rfind(")") + 2 :].split()


def process_cpu_seconds(pid: int, include_reaped_children: bool = True) -> float:
    """utime + stime of one process (and of its children it has waited for)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # after the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
    ticks = int(fields[11]) + int(fields[12])
    if include_reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from the ppid field of every /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its live descendants."""
    return process_cpu_seconds(pid) + sum(
        process_cpu_seconds(c, include_reaped_children=False) for c in descendants(pid)
    )


def system_cpu_times() -> tuple[float, float]:
    """(busy, total) seconds summed over all cores since boot, from /proc/stat."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in first]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


# --- ports and readiness ------------------------------------------------------------------


def bench_port_range(count: int, start: int, stride: int = 1) -> int:
    """Free loopback ports for a benchmark (``backends.process.free_port_range``), the search
    started at an offset of ``start`` that depends on this process's id, so that benchmarks
    run side by side on one machine do not all race for the same first ports."""
    offset = (os.getpid() % 64) * 16 * max(count * stride, 1)
    if start + offset + count * stride < 60000:
        start += offset
    return free_port_range(count, start=start, stride=stride)


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net/tcp{,6}."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) <= 9 or fields[3] != "0A":  # 0A: LISTEN
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def owns_listener(pid: int, port: int) -> bool:
    """Does ``pid`` (or one of its descendants) hold the socket listening on ``port``?"""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not wanted:
        return False
    for each in (pid, *descendants(pid)):
        try:
            fds = list(Path(f"/proc/{each}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if str(fd.readlink()) in wanted:
                    return True
            except OSError:
                continue
    return False


def wait_own_http(url: str, timeout_s: float, proc: ChildProcess) -> None:
    """``wait_http`` that counts the answer only once ``proc`` itself listens on the URL's
    port: on a shared machine another process can take a port that looked free when it was
    picked (the process under test then fails to bind while the other one answers)."""
    wait_http(url, timeout_s, proc)
    port = httpx.URL(url).port
    if port is not None:
        wait_until(
            lambda: owns_listener(proc.pid, port),
            timeout_s,
            f"{proc.name} listening on port {port} (another process answers there)",
            watch=(proc,),
        )


# --- managed processes --------------------------------------------------------------------


class ManagedProcess(ChildProcess):
    """A benchmark's child: its own log file and process group, ``env`` added to ours."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        env = {**os.environ, **(env or {})}
        super().__init__(argv, name=name, log_path=log_path, env=env, cwd=cwd)

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid) if self.alive() else 0.0


def kvgate_argv(*args: str) -> list[str]:
    """Run a kvgate sub-command with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "kvgate.router.cli", *args]


# --- the simulated fleet ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetSpec:
    replicas: int = 4
    speedup: float = 1.0
    capacity_blocks: int | None = None
    block_size: int = 16
    topic: str = ""  # empty: vllm-router kv_aware only reads empty-topic events
    event_encoding: str | None = None
    extra_args: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()
    """Pin the fleet's processes to these CPUs (``--fleet-cpu``; empty: not pinned)."""
    processes: int = 1
    """Split the replicas over this many ``kvgate sim`` processes (``--fleet-processes``),
    each with an event loop of its own; ports and seeds do not change."""
    engine: str = "sim"
    """What the replicas are: ``sim`` (kvgate's simulator), or an engine we did not write
    (``bench.engines``: ``vllm``, ``dynamo-mocker``; ``sglang`` once its launcher lands)."""
    engine_args: tuple[str, ...] = ()
    """Extra arguments for each replica of an engine other than the simulator."""

    def shares(self) -> list[range]:
        """The replica indices each process runs: contiguous, as even as they divide."""
        count = max(1, min(self.processes, self.replicas))
        bounds = [self.replicas * k // count for k in range(count + 1)]
        return [range(a, b) for a, b in itertools.pairwise(bounds)]


class BenchFleet(Protocol):
    """A fleet a benchmark runs routers on: the simulator's (``SimFleet``) or replicas of an
    engine we did not write (``bench.engines``). Events and replay endpoints are where a
    subscriber connects, one per replica."""

    @property
    def urls(self) -> list[str]: ...

    @property
    def event_endpoints(self) -> list[str]: ...

    @property
    def replay_endpoints(self) -> list[str]: ...

    @property
    def block_size(self) -> int: ...

    @property
    def tokenizer(self) -> Path:
        """A Hugging Face tokenizer directory producing the replicas' token ids."""

    @property
    def model(self) -> str:
        """The model name the replicas serve."""

    @property
    def topic(self) -> str: ...

    @property
    def engine(self) -> str:
        """``sim`` or the engine's name (``FleetSpec.engine``)."""

    def cpu_seconds(self) -> float: ...

    def stop(self) -> None: ...


@dataclass
class SimFleet:
    """``kvgate sim`` with N replicas (in one process or several): HTTP on
    ``http_port + i``, events PUB on ``events_port + 2 i`` and replay on the port after each."""

    spec: FleetSpec
    http_port: int
    events_port: int
    processes: list[ManagedProcess]

    @property
    def urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{self.http_port + i}" for i in range(self.spec.replicas)]

    @property
    def event_endpoints(self) -> list[str]:
        return [f"tcp://{LOOPBACK}:{self.events_port + 2 * i}" for i in range(self.spec.replicas)]

    @property
    def replay_endpoints(self) -> list[str]:
        return [
            f"tcp://{LOOPBACK}:{self.events_port + 2 * i + 1}" for i in range(self.spec.replicas)
        ]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def tokenizer(self) -> Path:
        return tokenizer_dir()

    @property
    def model(self) -> str:
        return SIM_MODEL

    @property
    def topic(self) -> str:
        return self.spec.topic

    @property
    def engine(self) -> str:
        return "sim"

    def cpu_seconds(self) -> float:
        return sum(proc.cpu_seconds() for proc in self.processes)

    def stop(self) -> None:
        for proc in self.processes:
            proc.stop()


def sim_args(
    spec: FleetSpec, http_port: int, events_port: int, share: range | None = None
) -> list[str]:
    """``kvgate sim`` arguments for ``spec`` (after the sub-command): the whole fleet, or
    the replicas of ``share`` only."""
    share = range(spec.replicas) if share is None else share
    args = [
        "--replicas",
        str(len(share)),
        "--first-replica",
        str(share.start),
        "--host",
        LOOPBACK,
        "--port",
        str(http_port),
        "--events-port",
        str(events_port),
        "--speedup",
        str(spec.speedup),
        "--block-size",
        str(spec.block_size),
        f"--topic={spec.topic}",
    ]
    if spec.capacity_blocks is not None:
        args += ["--capacity-blocks", str(spec.capacity_blocks)]
    if spec.event_encoding is not None:
        args += ["--event-encoding", spec.event_encoding]
    return args + list(spec.extra_args)


def sim_argv(
    spec: FleetSpec, http_port: int, events_port: int, share: range | None = None
) -> list[str]:
    return kvgate_argv("sim", *sim_args(spec, http_port, events_port, share))


def sim_config(spec: FleetSpec) -> SimConfig:
    """The configuration the fleet of ``spec`` runs with, parsed by ``kvgate sim`` itself."""
    return sim_cli.config_from_args(sim_cli.build_parser().parse_args(sim_args(spec, 0, 0)))


def pinned(argv: list[str], cpus: Sequence[int]) -> list[str]:
    """``argv`` run on ``cpus`` only (``taskset``; every thread it starts too), or as is."""
    if not cpus:
        return argv
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("pinning the fleet to CPUs needs taskset (util-linux)")
    return [taskset, "--cpu-list", ",".join(str(c) for c in cpus), *argv]


@contextlib.contextmanager
def cpus_apart(cpus: Sequence[int]) -> Iterator[None]:
    """This thread (the load generator, and every process it starts: the router under test)
    kept off ``cpus`` while inside, so neither slows the fleet pinned there; as is without."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    rest = before - set(cpus)
    if not rest:
        raise RuntimeError(f"no CPU left for the benchmark beside the fleet's {sorted(cpus)}")
    os.sched_setaffinity(0, rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start_fleet(spec: FleetSpec, log_dir: Path, timeout_s: float = 60.0) -> SimFleet:
    """Start the simulated fleet on free loopback ports and wait until every replica is up."""
    http_port = bench_port_range(spec.replicas, start=21000)
    events_port = bench_port_range(2 * spec.replicas, start=25000)
    fleet = SimFleet(spec, http_port, events_port, [])
    try:
        for share in spec.shares():
            name = "sim" if len(share) == spec.replicas else f"sim-{share.start}"
            argv = pinned(sim_argv(spec, http_port, events_port, share), spec.cpus)
            proc = ManagedProcess(name, argv, log_dir / f"{name}.log").start()
            fleet.processes.append(proc)
            for i in share:
                wait_own_http(f"{fleet.urls[i]}/health", timeout_s, proc)
    except (TimeoutError, RuntimeError):
        fleet.stop()
        raise
    return fleet


# --- kvgate under test --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvgateSpec:
    policy: str
    env: tuple[tuple[str, str], ...] = ()  # e.g. KVGATE_SCORING__FOOTPRINT_WEIGHT
    extra_args: tuple[str, ...] = ()
    tree: Path | None = None
    """Run kvgate from this checkout instead of this one (an older commit, side by side):
    ``python -m kvgate.router.cli`` started in it imports its packages first."""
    variant: str | None = None
    """A variant built in code (``bench.variants``): ``python -m kvgate.bench.variants NAME``."""
    roles: tuple[str, ...] = ()
    """Each replica's worker role, in order (docs/pd.md; empty: whole-request workers)."""
    bootstrap: bool = False
    """Prefill workers speak SGLang's bootstrap protocol (the simulator's bootstrap server:
    each replica's HTTP port)."""


def port_of(url: str) -> int:
    """The port of a replica's ``http://host:port`` URL (a simulated replica's bootstrap
    server for SGLang's P/D protocol is its HTTP port)."""
    return int(url.rsplit(":", 1)[1])


def pd_roles(replicas: int) -> tuple[str, ...]:
    """A disaggregated fleet's roles: the first half of the replicas prefill, the rest
    decode (every P/D router of a comparison splits the fleet the same way)."""
    prefill = max(replicas // 2, 1)
    return ("prefill",) * prefill + ("decode",) * (replicas - prefill)


def kvgate_serve_argv(spec: KvgateSpec, fleet: BenchFleet, port: int) -> list[str]:
    """``kvgate serve`` wired to the fleet's replicas, events and tokenizer (a variant built
    in code: ``python -m kvgate.bench.variants NAME`` with the same flags)."""
    model = fleet.model
    flags = [
        "--host", LOOPBACK, "--port", str(port), "--policy", spec.policy,
        "--tokenizer", f"{model}={fleet.tokenizer}", "--log-level", "warning",
    ]  # fmt: skip
    if spec.variant is not None:
        argv = [sys.executable, "-m", "kvgate.bench.variants", spec.variant, *flags]
    else:
        argv = kvgate_argv("serve", *flags)
    roles = [""] * len(fleet.urls)  # whole-request workers (and older trees: no role option)
    if spec.roles:
        roles = [
            _role_option(r, u, spec.bootstrap) for r, u in zip(spec.roles, fleet.urls, strict=True)
        ]
    for url, events, replay, role in zip(
        fleet.urls, fleet.event_endpoints, fleet.replay_endpoints, roles, strict=True
    ):
        option = f"{url},models={model},events={events},replay={replay}{role}"
        engine = getattr(fleet, "worker_engine", None)  # an engine fleet's kind (bench.engines)
        argv += ["--worker", option if engine is None else f"{option},engine={engine}"]
    return argv + list(spec.extra_args)


def _role_option(role: str, url: str, bootstrap: bool) -> str:
    """A worker entry's role option (and a prefill worker's bootstrap port: SGLang's
    protocol, served by a simulated replica on its HTTP port)."""
    if bootstrap and role == "prefill":
        return f",role={role},bootstrap_port={port_of(url)}"
    return f",role={role}"


def start_kvgate(
    spec: KvgateSpec, fleet: BenchFleet, log_dir: Path, timeout_s: float = 60.0
) -> tuple[ManagedProcess, str]:
    port = bench_port_range(1, start=18000)
    proc = ManagedProcess(
        f"kvgate-{spec.policy}",
        kvgate_serve_argv(spec, fleet, port),
        log_dir / f"kvgate-{spec.policy}.log",
        env=dict(spec.env),
        cwd=spec.tree,
    ).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_own_http(f"{url}/ready", timeout_s, proc)
    except (TimeoutError, RuntimeError):
        proc.stop()
        raise
    return proc, url
