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
    speculated: bool  # the adaptive switch chose speculation for it


class StepTimer:
    """`with StepTimer(llm.engine) as timer: llm.generate(...)`; then `timer.steps`, `timer.stalls()`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[TimedStep] = []

    def __enter__(self) -> Self:
        engine, step = self.engine, self.engine.step

        def timed_step():
            spec = engine.spec
            steps_on = spec.counters.steps_on if spec is not None else 0
            started_s = time.perf_counter()
            updates = step()
            duration_s = time.perf_counter() - started_s
            caught_up = bool(spec is not None and spec.draft is not None and spec.draft.caught_up)
            speculated = spec is not None and spec.counters.steps_on > steps_on
            self.steps.append(TimedStep(duration_s, engine.last_step_shape, caught_up, speculated))
            return updates

        self._shadowed = engine.__dict__.get("step")  # another wrapper already installed, if any
        engine.step = timed_step  # an instance attribute shadows the method until __exit__
        return self

    def __exit__(self, *exc) -> None:
        if self._shadowed is None:
            del self.engine.step
        else:
            self.engine.step = self._shadowed

    def stalls(self, factor: float = 5.0, floor_s: float = 0.005) -> list[TimedStep]:
        """Steps longer than `factor` x the median step and than `floor_s`, slowest first."""
        if not self.steps:
            return []
        limit = max(factor * statistics.median(s.duration_s for s in self.steps), floor_s)
        return sorted((s for s in self.steps if s.duration_s > limit), reverse=True)

    def pattern(self, limit: int = 24) -> str:
        """The switch's decisions over the round's decode steps, run-length coded: "P3 S40 P3 S81" is 3
        plain steps, 40 speculative, ... (steps with a prompt chunk are left out); at most `limit` runs."""
        runs: list[list] = []
        for step in self.steps:
            if step.shape[0] > step.shape[1] and not step.speculated:
                continue  # a prompt chunk was in it
            mode = "S" if step.speculated else "P"
            if runs and runs[-1][0] == mode:
                runs[-1][1] += 1
            else:
                runs.append([mode, 1])
        text = " ".join(f"{mode}{count}" for mode, count in runs[:limit])
        return text + (" ..." if len(runs) > limit else "")

    def stall_seconds(self, **kwargs) -> float:
        """Time the stalled steps spent beyond the median step."""
        median = statistics.median(s.duration_s for s in self.steps) if self.steps else 0.0
        return sum(s.duration_s - median for s in self.stalls(**kwargs))
