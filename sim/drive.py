"""`run_now(coro)`: the value of a coroutine that never suspends, without an event loop.

The router's routing policies and prefix index are async (a Redis index awaits the network), but the
in-process index answers without awaiting anything, so the simulator drives them synchronously: one
`send(None)` runs the coroutine to its end. A coroutine that does suspend would need a loop the
simulator does not have: that is a bug in the caller, raised at once rather than answered wrongly.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    name = getattr(coro, "__qualname__", repr(coro))
    coro.close()
    raise RuntimeError(f"{name} suspended: the simulator only drives coroutines that complete without waiting")
