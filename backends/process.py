"""Child processes and ports on 127.0.0.1: pick free ports, start a child, wait until it is
ready (bounded by a deadline), stop it with SIGTERM and then SIGKILL.

One helper for everything kvgate starts: the simulated fleet of ``kvgate serve --sim``
(``router.simfleet``), the benchmarks' fleets and routers (``bench.fleet``), real vLLM
replicas (``backends.vllm_cpu.launch``) and the tests' servers. Every call blocks: it is for
command lines, benchmarks and test fixtures, never for code on the event loop.

A child started with ``own_group`` (the default) leads its own session and process group:
stopping it signals the whole group (an engine's worker processes go with it) and waits until
none of them runs. Without it the child shares our group (Ctrl-C reaches both) and only the
child itself is signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Self

import httpx

from kvgate.backends.errors import ProcessExited

LOOPBACK = "127.0.0.1"
_REAP_S = 5.0  # after the last signal, how long the leader may take to be reaped


# -- ports -------------------------------------------------------------------------------


def port_free(port: int, host: str = LOOPBACK) -> bool:
    """Nobody listens on ``port`` (TIME_WAIT leftovers do not count, as for the servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port the kernel picks, free at this instant (nobody listens: connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
    return port


def free_port_range(count: int, start: int = 20000, stride: int = 1, end: int = 60000) -> int:
    """First port p >= ``start`` such that p, p+stride, ... (``count`` ports) are all free."""
    port = start
    while port + count * stride < end:
        if all(port_free(port + i * stride) for i in range(count)):
            return port
        port += count * stride
    raise RuntimeError(f"no run of {count} free ports on {LOOPBACK} in {start}..{end}")


def _ephemeral_ports() -> range:
    """The kernel's ephemeral range: ports it hands out on its own (engines use many)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


class PortAllocator:
    """Hands out ports free on 127.0.0.1, outside the ephemeral range (so a process binding
    port 0 meanwhile, as vLLM's internals do, cannot take one before its owner binds it),
    never the same port twice."""

    def __init__(self, start: int | None = None) -> None:
        self._next = start if start is not None else 20000 + (os.getpid() * 7) % 10000
        self._ephemeral = _ephemeral_ports()

    def take(self, count: int = 1) -> list[int]:
        found: list[int] = []
        scanned = 0
        while len(found) < count:
            port, self._next = self._next, self._next + 1
            if self._next >= 65536:
                self._next = 1024
            scanned += 1
            if scanned > 65536:
                raise RuntimeError(f"no free port on {LOOPBACK}")
            if port not in self._ephemeral and port_free(port):
                found.append(port)
        return found

    def one(self) -> int:
        return self.take(1)[0]


# -- processes ---------------------------------------------------------------------------


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run (zombies waiting to be reaped do not)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in {"Z", "X"}:
            members.append(int(stat.parent.name))
    return members


def kill_group(
    pgid: int, timeout: float = 20.0, leader: subprocess.Popen[bytes] | None = None
) -> None:
    """SIGTERM a process group, then SIGKILL whatever still runs after ``timeout``.

    ``leader`` (our own child, the group leader) is reaped as soon as it exits."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        if not _live_members(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


class ChildProcess:
    """One child process: stdin closed, output to ``log_path`` (or to ours), ``env`` its
    whole environment (``None``: ours); see the module's note on ``own_group``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        own_group: bool = True,
        append_log: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.name = name
        self.log_path = log_path
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.own_group = own_group
        self.append_log = append_log
        self.popen: subprocess.Popen[bytes] | None = None
        self._stopped = False

    def start(self) -> Self:
        self._stopped = False
        if self.log_path is None:
            self.popen = self._spawn(None)
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab" if self.append_log else "wb") as log:
            self.popen = self._spawn(log)
        return self

    def _spawn(self, log: IO[bytes] | None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=None if log is None else subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=self.own_group,
        )

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} not started")
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def exit_code(self) -> int | None:
        """The exit status once it exited (``-N``: killed by signal N); ``None`` before."""
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return "(no log)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def exited(self) -> ProcessExited:
        """The error saying it exited (with the tail of its log)."""
        where = "" if self.log_path is None else f"; log {self.log_path}:\n{self.log_tail(20)}"
        code = self.exit_code()
        return ProcessExited(
            f"{self.name} exited with code {code}{where}", name=self.name, returncode=code
        )

    def terminate(self) -> None:
        """SIGTERM (its group, with ``own_group``) without waiting."""
        if self.popen is None or self._stopped:
            return
        if not self.own_group and self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.own_group:
                os.killpg(self.popen.pid, signal.SIGTERM)
            else:
                self.popen.terminate()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, SIGKILL whatever still runs ``timeout_s`` later; the child is reaped.

        Once stopped, never signalled again (its pid may belong to another process by then)."""
        popen = self.popen
        if popen is None or self._stopped:
            return
        self._stopped = True
        if self.own_group:
            kill_group(popen.pid, timeout_s, leader=popen)
        elif popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(_REAP_S)


# -- readiness ---------------------------------------------------------------------------


def wait_until(
    ready: Callable[[], bool],
    timeout_s: float,
    what: str | Callable[[], str],
    *,
    poll_s: float = 0.2,
    watch: Iterable[ChildProcess] = (),
) -> None:
    """Call ``ready`` every ``poll_s`` until it holds.

    Raises ``ProcessExited`` as soon as a process of ``watch`` has exited, and
    ``TimeoutError`` naming ``what`` once ``timeout_s`` has passed."""
    watched = list(watch)
    deadline = time.monotonic() + timeout_s
    while True:
        for process in watched:
            if not process.alive():
                raise process.exited()
        if ready():
            return
        if time.monotonic() > deadline:
            shown = what if isinstance(what, str) else what()
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {shown}")
        time.sleep(poll_s)


def _http_problem(client: httpx.Client, url: str) -> str | None:
    """Why ``GET url`` is not a 200 (``None``: it is)."""
    try:
        status = client.get(url).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return None if status == 200 else f"HTTP {status}"


def http_ready(client: httpx.Client, url: str) -> bool:
    """One probe: does ``GET url`` answer 200? (A refused or broken connection: no.)"""
    return _http_problem(client, url) is None


def wait_http(
    urls: str | Iterable[str],
    timeout_s: float,
    process: ChildProcess | None = None,
    *,
    poll_s: float = 0.2,
    probe_timeout_s: float = 2.0,
) -> None:
    """Poll every URL until each has answered 200 once; fail early if ``process`` exits."""
    pending = [urls] if isinstance(urls, str) else list(urls)
    last: dict[str, str] = {}

    def ready() -> bool:
        for url in list(pending):
            problem = _http_problem(client, url)
            if problem is None:
                pending.remove(url)
            else:
                last[url] = problem
        return not pending

    def what() -> str:
        return ", ".join(f"{url} ({last.get(url, '-')})" for url in pending)

    watch = () if process is None else (process,)
    with httpx.Client(timeout=probe_timeout_s, trust_env=False) as client:
        wait_until(ready, timeout_s, what, poll_s=poll_s, watch=watch)
