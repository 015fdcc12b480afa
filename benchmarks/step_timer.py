"""Per-step wall times of an engine during a benchmark round, and the steps that stalled.

A round's TPOT hides where its time went: one step that takes 50 ms (a first call at a new shape, a
library building a plan for a new input size, a collection) reads like 0.4 ms more per token over a
128-token request. `StepTimer` wraps `engine.step` while installed and keeps every step's duration,
shape (tokens computed, sequences, KV tokens read: `LLMEngine.last_step_shape`) and, with a draft
model, whether the draft caught up KV in it; `stalls()` lists the steps far above the round's median.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple, Self


class TimedStep(NamedTuple):
    duration_s: float
    shape: tuple[int, int, int]
    draft_caught_up: bool


class StepTimer:
    """`with StepTimer(llm.engine) as timer: llm.generate(...)`; then `timer.steps`, `timer.stalls()`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[TimedStep] = []

    def __enter__(self) -> Self:
        engine, step = self.engine, self.engine.step

        def timed_step():
            started_s = time.perf_counter()
            updates = step()
            draft = engine.spec.draft if engine.spec is not None else None
            caught_up = bool(draft is not None and draft.caught_up)
            self.steps.append(TimedStep(time.perf_counter() - started_s, engine.last_step_shape, caught_up))
            return updates

        engine.step = timed_step  # an instance attribute shadows the method until __exit__
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step

    def stalls(self, factor: float = 5.0, floor_s: float = 0.005) -> list[TimedStep]:
        """Steps longer than `factor` x the median step and than `floor_s`, slowest first."""
        if not self.steps:
            return []
        limit = max(factor * statistics.median(s.duration_s for s in self.steps), floor_s)
        return sorted((s for s in self.steps if s.duration_s > limit), reverse=True)

    def stall_seconds(self, **kwargs) -> float:
        """Time the stalled steps spent beyond the median step."""
        median = statistics.median(s.duration_s for s in self.steps) if self.steps else 0.0
        return sum(s.duration_s - median for s in self.stalls(**kwargs))
