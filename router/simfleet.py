"""The simulated fleet behind ``kvgate serve --sim N``: a ``kvgate sim`` subprocess.

Port scheme: replica i (0-based) serves HTTP on ``base_port + i``, publishes KV events on
``events_port + 2i`` and answers replays on ``events_port + 2i + 1``.
"""

from __future__ import annotations

import logging
import os
import sys
from types import TracebackType
from typing import Any

from kvgate.backends.errors import ProcessExited
from kvgate.backends.process import ChildProcess, wait_http

log = logging.getLogger("kvgate.sim")

SIM_MODEL = "kvgate-sim"
BASE_PORT = 9001
EVENTS_PORT = 5557
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class SimFleetError(RuntimeError):
    """The simulated fleet did not come up."""


class SimFleet:
    """Start ``replicas`` simulated engines; stop them when the ``with`` block ends."""

    def __init__(
        self,
        replicas: int,
        *,
        base_port: int = BASE_PORT,
        events_port: int = EVENTS_PORT,
        roles: list[str] | None = None,
    ) -> None:
        self.replicas = replicas
        self.roles = roles or ["both"] * replicas  # each replica's worker role
        self.base_port = base_port
        self.events_port = events_port
        self._process: ChildProcess | None = None

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "kvgate.router.cli", "sim",
            "--replicas", str(self.replicas),
            "--port", str(self.base_port),
            "--events-port", str(self.events_port),
            "--parent-pid", str(os.getpid()),  # killed outright, we leave no replicas behind
        ]  # fmt: skip

    def worker_specs(self) -> list[str]:
        specs = []
        for i in range(self.replicas):
            events = self.events_port + 2 * i
            specs.append(
                f"http://127.0.0.1:{self.base_port + i},models={SIM_MODEL},role={self.roles[i]},"
                f"events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{events + 1}"
            )
        return specs

    def settings_overrides(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """``overrides`` plus the simulated workers and the simulator's tokenizer."""
        from kvgate.backends.sim.tokenizer import tokenizer_dir  # noqa: PLC0415 - only with --sim

        tokenizers = [*(overrides.get("tokenizers") or []), f"{SIM_MODEL}={tokenizer_dir()}"]
        workers = [*(overrides.get("workers") or []), *self.worker_specs()]
        return {**overrides, "workers": workers, "tokenizers": tokenizers}

    def __enter__(self) -> SimFleet:
        log.info("starting %d simulated replicas: %s", self.replicas, " ".join(self.command))
        # In our process group: a Ctrl-C reaches it too; it watches our pid besides.
        self._process = ChildProcess(self.command, name="kvgate sim", own_group=False).start()
        try:
            self._wait_healthy(self._process)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_healthy(self, process: ChildProcess) -> None:
        """Poll every replica's /health until all answer (bounded by START_TIMEOUT_S)."""
        urls = [f"http://127.0.0.1:{self.base_port + i}/health" for i in range(self.replicas)]
        try:
            wait_http(urls, START_TIMEOUT_S, process, poll_s=0.1, probe_timeout_s=1.0)
        except ProcessExited as exc:
            raise SimFleetError(f"kvgate sim exited with code {exc.returncode}") from exc
        except TimeoutError as exc:
            raise SimFleetError(f"simulated replicas not healthy: {exc}") from exc

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.stop(STOP_TIMEOUT_S)
