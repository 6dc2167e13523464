"""kvgate itself as a real server: ``python -m kvgate.router.cli serve``, in its own group."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from kvgate.backends.errors import ProcessExited
from kvgate.backends.process import ChildProcess, wait_until

READY_TIMEOUT_S = 60.0


class KvgateServer:
    """One kvgate gateway on 127.0.0.1 in front of the given ``--worker`` specs."""

    def __init__(
        self,
        workers: Sequence[str],
        tokenizer: Path | None,
        log_path: Path,
        port: int,
        extra_args: Sequence[str] = (),
        block_size: int | None = 32,
        dp_size: int = 1,
    ) -> None:
        """``tokenizer``: given as ``--tokenizer`` (None: the engines tokenize);
        ``block_size``: given as ``--index-block-size`` (None: kvgate adopts the engines');
        ``dp_size``: data-parallel ranks of every worker (an event subscriber each)."""
        self.dp_size = dp_size
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = list(workers)
        self.log_path = log_path
        self.args = [
            sys.executable,
            "-m",
            "kvgate.router.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            "kv",
            *(("--tokenizer", str(tokenizer)) if tokenizer is not None else ()),
            *(("--index-block-size", str(block_size)) if block_size is not None else ()),
            "--health-interval-s",
            "0.5",
            *(arg for spec in workers for arg in ("--worker", spec)),
            *extra_args,
        ]
        self._proc = ChildProcess(self.args, name="kvgate", log_path=log_path, append_log=True)

    def log_tail(self, lines: int = 60) -> str:
        return self._proc.log_tail(lines)

    def start(self) -> KvgateServer:
        self._proc.start()
        try:
            self._wait_ready()
            self._wait_joined()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready: Any, what: str) -> None:
        """``ready()`` within READY_TIMEOUT_S, kvgate running; else a failure with its log."""
        try:
            wait_until(ready, READY_TIMEOUT_S, what, watch=[self._proc])
        except (ProcessExited, TimeoutError) as exc:
            raise AssertionError(f"{exc}; log {self.log_path}:\n{self.log_tail()}") from exc

    def _ready(self, client: httpx.Client) -> bool:
        """Every worker healthy and every event subscriber connected."""
        try:
            workers = client.get(f"{self.url}/admin/workers").json()["workers"]
            index = client.get(f"{self.url}/debug/index").json()
        except httpx.TransportError:
            return False
        if len(workers) != len(self.workers) or not all(w["healthy"] for w in workers):
            return False
        subscribers = [s for w in index["workers"].values() for s in w["subscribers"]]
        expected = len(self.workers) * self.dp_size
        return len(subscribers) == expected and all(s["connected"] for s in subscribers)

    def _wait_ready(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            self._wait(lambda: self._ready(client), "kvgate to be ready")

    def _wait_joined(self) -> None:
        """Make every engine publish once, then wait until kvgate has replayed its history.

        kvgate learns an engine's existing cache when the first live batch arrives after it
        subscribes (it then replays from seq 0): until then a fresh kvgate predicts no hits
        on an engine that already holds blocks. A fresh, uncached prompt of two blocks per
        engine triggers it, so the tests start from a complete index."""
        urls = [spec.split(",", 1)[0] for spec in self.workers]
        with httpx.Client(timeout=60.0) as client:
            for url in urls:
                for rank in range(self.dp_size):  # every rank publishes once
                    prompt = f"prime {self.port} {url} {rank} " * 16  # unique: a new event
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                    headers = {"x-data-parallel-rank": str(rank)} if self.dp_size > 1 else {}
                    reply = client.post(f"{url}/v1/completions", json=body, headers=headers)
                    reply.raise_for_status()
            self._wait(lambda: self._joined(client), "kvgate to replay the engines' history")

    def _joined(self, client: httpx.Client) -> bool:
        index = client.get(f"{self.url}/debug/index").json()
        subscribers = [s for w in index["workers"].values() for s in w["subscribers"]]
        return all(s["history_complete"] and s["applied_seq"] is not None for s in subscribers)

    def stop(self) -> None:
        self._proc.stop(timeout_s=10.0)

    def __enter__(self) -> KvgateServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def index_stats(client: httpx.Client) -> dict[str, Any]:
    stats: dict[str, Any] = client.get("/debug/index").json()
    return stats


def route_explain(
    client: httpx.Client, body: dict[str, Any], session: str | None = None
) -> dict[str, Any]:
    """kvgate's ``POST /debug/route`` answer for a request body (nothing is sent upstream),
    with ``session`` as its ``x-session-id`` (ties break on its hash)."""
    headers = {"x-session-id": session} if session is not None else None
    reply = client.post("/debug/route", json=body, headers=headers)
    reply.raise_for_status()
    explained: dict[str, Any] = reply.json()
    return explained


def matched_blocks(explained: dict[str, Any], worker_url: str) -> int:
    for entry in explained["workers"]:
        if entry["worker"] == worker_url and entry.get("eligible"):
            blocks: dict[str, int] = entry["matched_blocks"]
            return sum(blocks.values())
    return 0
