"""The tests' one way to wait for a condition, and to pick a free port.

``wait_until`` polls a condition (a function, or a coroutine function) until it holds and
fails after a bounded time: state changes in these tests have no event to await, and a fixed
sleep is never a test. ``free_port`` is the product's (``backends.process``): a loopback port
free at this instant.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from kvgate.backends.process import free_port

__all__ = ["free_port", "wait_until"]

POLL_S = 0.005


async def wait_until(
    predicate: Callable[[], bool] | Callable[[], Awaitable[bool]],
    limit_s: float = 10.0,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` until it holds; ``AssertionError`` naming ``what`` after
    ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while True:
        result = predicate()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s:g} s waiting for {what}")
        await asyncio.sleep(POLL_S)
