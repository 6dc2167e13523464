"""``backends.process``: free ports, child processes stopped with SIGTERM then SIGKILL (their
whole process group), readiness waits bounded by a deadline, on real processes and sockets."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvgate.backends.errors import ProcessExited
from kvgate.backends.process import (
    ChildProcess,
    PortAllocator,
    free_port,
    free_port_range,
    http_ready,
    kill_group,
    port_free,
    wait_http,
    wait_until,
)

# A parent that starts a grandchild, says so, and then sleeps (both end only when killed).
FAMILY = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)
# A process that ignores SIGTERM once it has said so.
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring SIGTERM', flush=True)\n"
    "time.sleep(60)\n"
)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _logged(path: Path, text: str) -> bool:
    return path.is_file() and text in path.read_text()


def test_port_allocator_skips_taken_and_ephemeral_ports() -> None:
    ports = PortAllocator(start=24000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 24001))
        taken.listen()
        first = ports.take(3)
    assert 24001 not in first
    assert len(set(first + ports.take(3))) == 6
    near_ephemeral = PortAllocator(start=32760).take(10)
    assert all(port < 32768 or port > 60999 for port in near_ephemeral)


def test_free_port_range_skips_a_run_with_a_listener() -> None:
    start = free_port_range(3, start=31500)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", start + 1))
        taken.listen()
        assert not port_free(start + 1)
        again = free_port_range(3, start=start)
    assert again >= start + 3 and all(port_free(again + i) for i in range(3))
    assert free_port_range(2, start=start, stride=2) >= start


def test_free_port_refuses_connections() -> None:
    with socket.socket() as sock:
        sock.settimeout(2.0)
        assert sock.connect_ex(("127.0.0.1", free_port())) != 0


def test_kill_group_ends_the_leader_and_its_children() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    child_pid = int(leader.stdout.readline())
    kill_group(leader.pid, timeout=10.0, leader=leader)
    assert leader.wait(timeout=5.0) != 0
    leader.stdout.close()
    assert _gone(child_pid)


def test_a_child_in_its_own_group_is_stopped_with_its_children(tmp_path: Path) -> None:
    log = tmp_path / "family.log"
    log.write_text("earlier run\n")
    family = ChildProcess([sys.executable, "-c", FAMILY], name="family", log_path=log).start()
    wait_until(lambda: log.read_text().strip().isdigit(), 30, "the grandchild", poll_s=0.02)
    grandchild = int(log.read_text())  # the log was truncated: only this run's line
    assert family.alive() and family.exit_code() is None
    family.stop(timeout_s=10.0)
    assert family.exit_code() == -signal.SIGTERM
    assert _gone(grandchild)
    family.stop()  # idempotent


def test_append_log_keeps_what_was_there(tmp_path: Path) -> None:
    log = tmp_path / "sub" / "echo.log"
    for word in ("one", "two"):
        echo = ChildProcess(
            [sys.executable, "-c", f"print({word!r})"], name="echo", log_path=log, append_log=True
        ).start()
        assert echo.popen is not None and echo.popen.wait(timeout=30) == 0
    assert log.read_text().split() == ["one", "two"]


def test_a_child_ignoring_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    stubborn = ChildProcess(
        [sys.executable, "-c", STUBBORN], name="stubborn", log_path=log, own_group=False
    ).start()
    wait_until(lambda: _logged(log, "ignoring"), 30, "the handler", poll_s=0.02)
    stubborn.stop(timeout_s=0.5)
    assert stubborn.exit_code() == -signal.SIGKILL


def test_waiting_on_a_process_that_exits_fails_at_once_with_its_log(tmp_path: Path) -> None:
    crash = "import sys; print('no model here', flush=True); sys.exit(3)"
    log = tmp_path / "crash.log"
    process = ChildProcess([sys.executable, "-c", crash], name="engine", log_path=log).start()
    with pytest.raises(ProcessExited) as caught:
        wait_until(lambda: False, 60, "the engine", poll_s=0.02, watch=[process])
    assert caught.value.returncode == 3 and caught.value.name == "engine"
    assert "engine exited with code 3" in str(caught.value)
    assert "no model here" in str(caught.value)
    assert isinstance(caught.value, RuntimeError)


def test_a_wait_past_its_deadline_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match=r"timed out after 0\.1 s waiting for godot"):
        wait_until(lambda: False, 0.1, "godot", poll_s=0.02)


def test_wait_http_polls_a_real_server_until_it_answers(tmp_path: Path) -> None:
    port = free_port_range(1, start=31700)
    url = f"http://127.0.0.1:{port}/"
    argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    server = ChildProcess(argv, name="http.server", log_path=tmp_path / "http.log", cwd=tmp_path)
    with httpx.Client(timeout=2.0) as client:
        assert not http_ready(client, url)  # nothing listens yet
        server.start()
        try:
            wait_http(url, 30, server, poll_s=0.05)
            assert http_ready(client, url)
            with pytest.raises(TimeoutError, match="HTTP 404"):
                wait_http(url + "missing", 0.2, server, poll_s=0.05)
        finally:
            server.stop()
    assert not server.alive()
