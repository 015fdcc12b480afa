"""A serving process's startup heap, taken out of the garbage collector's way.

Once a worker or a router is ready to serve it holds hundreds of thousands of long-lived objects
(torch, transformers, Ray, gRPC, the model's modules) that will never become garbage. CPython's full
(generation 2) collection still walks every one of them each time it runs, holding the GIL: with
~0.5 M objects that was a 100-370 ms pause on a 2-core VM (timed with `gc.callbacks` in a
test process that hosts a router), during which the engine thread does not step and no stream the
router relays moves. `freeze_startup_heap` collects once, then moves what survives into the
permanent generation (`gc.freeze`, as vLLM does once its server is up), so later full collections
walk only what serving allocated since.

It changes interpreter-wide state: call it once, when a process of our own is ready to serve (a
worker actor after its engine is built, `splitserve serve` after its router listens), never from
code that runs inside a user's process. `gc.unfreeze()` undoes it.
"""

from __future__ import annotations

import gc
import time
from typing import Self


def freeze_startup_heap() -> int:
    """Collects, then freezes every object alive now; returns the permanent generation's size."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class CollectionPauses:
    """Times the collector's pauses while installed (`with CollectionPauses() as pauses:`): `count`
    and `longest_s` of the collections of `generation` or older (2: full collections only)."""

    def __init__(self, generation: int = 2) -> None:
        self.generation = generation
        self.count = 0
        self.longest_s = 0.0
        self.total_s = 0.0
        self._started_s: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation", 0) < self.generation:
            return
        if phase == "start":
            self._started_s = time.perf_counter()
        elif self._started_s is not None:
            pause_s = time.perf_counter() - self._started_s
            self.count, self.total_s = self.count + 1, self.total_s + pause_s
            self.longest_s = max(self.longest_s, pause_s)
            self._started_s = None

    def __enter__(self) -> Self:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def describe(self) -> str:
        return f"{self.count} collections of generation {self.generation}, longest {self.longest_s * 1e3:.0f} ms"
