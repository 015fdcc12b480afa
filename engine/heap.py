"""A serving process's startup heap, taken out of the garbage collector's way.

Once a worker or a router is ready to serve it holds hundreds of thousands of long-lived objects
(torch, transformers, Ray, gRPC, the model's modules) that will never become garbage. CPython's full
(generation 2) collection still walks every one of them each time it runs, holding the GIL: with
~0.5 M objects that was a 100-370 ms pause on the 2-core dev box (timed with `gc.callbacks` in a
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


def freeze_startup_heap() -> int:
    """Collects, then freezes every object alive now; returns the permanent generation's size."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
