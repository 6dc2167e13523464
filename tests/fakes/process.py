"""``kvgate serve`` as a real subprocess on 127.0.0.1 for a test."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import httpx

from kvgate.backends.process import free_port

ROOT = Path(__file__).resolve().parent.parent.parent
QUIET_HEALTH = ("--health-interval-s", "3600", "--health-metrics-interval-s", "0")


@asynccontextmanager
async def kvgate_process(
    worker: str,
    log_path: Path,
    *extra: str,
    stderr_path: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[tuple[int, asyncio.subprocess.Process]]:
    """``kvgate serve`` in front of ``worker`` (a ``--worker`` spec), round robin, no index,
    quiet health; stdout to ``log_path`` (stderr too, unless ``stderr_path``); killed if
    still alive at the end. ``env`` is added to this process's environment (less any
    ``KVGATE_*`` and ``OTEL_*`` variable)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    command = [
        "-m", "kvgate.router.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--worker", worker, "--policy", "round_robin", "--no-kv-index", *QUIET_HEALTH, *extra,
    ]  # fmt: skip
    with ExitStack() as files:
        stdout = files.enter_context(log_path.open("wb"))
        stderr = files.enter_context(stderr_path.open("wb")) if stderr_path else subprocess.STDOUT
        process = await asyncio.create_subprocess_exec(
            sys.executable, *command, cwd=ROOT, env={**base, **(env or {})},
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        )  # fmt: skip
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                await poll_ready(client, f"http://127.0.0.1:{port}/ready", process)
            yield port, process
        finally:
            if process.returncode is None:
                process.kill()
            await asyncio.wait_for(process.wait(), 10)


async def poll_ready(
    client: httpx.AsyncClient, url: str, process: asyncio.subprocess.Process
) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.returncode is None, "kvgate serve exited during start"
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("kvgate serve never became ready")
