"""Waiting for an event by polling it, for tests: never a fixed sleep that hopes the event
came (too short on a loaded machine, too long everywhere else)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
             every_s: float = 0.02) -> Any:
    """Poll `check()` until it returns something truthy, and return that; AssertionError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(every_s)
    return found


async def eventually(check: Callable[[], Any], timeout: float = 10.0,
                     what: str = "condition", every_s: float = 0.02) -> Any:
    """`wait_for` inside an event loop, which keeps running meanwhile (its timers fire);
    `check` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(every_s)
