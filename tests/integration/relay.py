"""A ZMQ relay between a real vLLM publisher and kvgate that can drop frames (event gaps)."""

from __future__ import annotations

import threading

import zmq


class DroppingRelay:
    """SUB on the engine's PUB, re-published byte for byte on ``tcp://127.0.0.1:PORT``;
    ``drop(n)`` discards the next ``n`` frames (their seqs are kept in ``dropped``)."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], upstream: zmq.Socket[bytes], port: int
    ) -> None:
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._pub = context.socket(zmq.PUB)
        self._pub.bind(self.endpoint)
        self._sub = upstream
        self._lock = threading.Lock()
        self._to_drop = 0
        self.dropped: list[int] = []
        self.forwarded: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dropping-relay", daemon=True)

    def start(self) -> DroppingRelay:
        self._thread.start()
        return self

    def drop(self, frames: int) -> None:
        with self._lock:
            self._to_drop += frames

    def counts(self) -> tuple[int, int]:
        """(forwarded, dropped) so far."""
        with self._lock:
            return len(self.forwarded), len(self.dropped)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            with self._lock:
                if self._to_drop > 0:
                    self._to_drop -= 1
                    self.dropped.append(seq)
                    continue
                self.forwarded.append(seq)
            self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
