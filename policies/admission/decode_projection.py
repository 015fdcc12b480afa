"""Where a decode instance's batch will be at a future moment, from its running requests and the
fitted step time (Mooncake's point: admit on the load at the time the request arrives, not now).

The batch advances one token per sequence per step. Between two finishes the batch is fixed, so the
projection walks *segments* — runs of steps ending when the next sequence reaches its `max_tokens` —
and costs each step at the step time of the segment's start. (Contexts grow by one token per step
within a segment, so this slightly underestimates late steps of long segments; the SLO margin covers
it, and the number of segments stays at most one per running request however far we look ahead.)

A sequence is assumed to run to its `max_tokens`: it may stop earlier (EOS, stop string), which only
ever lowers the real load, so the projection is conservative. A sequence that reaches its last token
within `_EPS_S` of a moment counts as finished at it (float rounding must not flip exact cases).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from policies.admission.cost_model import DecodeStepFit
from policies.admission.view import RunningRequest

_EPS_S = 1e-9

Batch = tuple[tuple[int, int], ...]  # per sequence: (tokens still to generate, context tokens)


class Segment(NamedTuple):
    start_s: float  # from now
    step_s: float  # one step's time in this segment (0 when idle)
    steps: int  # steps until the next sequence finishes (0 when idle)
    batch_size: int  # sequences running throughout the segment (0 once the instance is idle)
    context_tokens: int  # their contexts' sum at the segment's start
    elapsed_steps: int  # steps taken from now to the segment's start
    order: Batch  # every sequence as it is now, by tokens left (shared by all segments, never copied)
    first: int  # order[first:] are the ones running in this segment

    def batch(self, extra_steps: int = 0) -> Batch:
        """The running sequences `extra_steps` steps into the segment (extra_steps < steps)."""
        done = self.elapsed_steps + extra_steps
        return tuple((left - done, context + done) for left, context in self.order[self.first :])


def segments(running: Sequence[RunningRequest], fit: DecodeStepFit) -> Iterator[Segment]:
    """The instance's future as segments, ending with one idle segment (batch_size 0).

    Sorting by tokens left once and keeping running sums makes the walk O(R log R) for R sequences."""
    order: Batch = tuple(
        sorted(
            (r.max_tokens - r.generated_tokens, r.context_tokens) for r in running if r.max_tokens > r.generated_tokens
        )
    )
    first, elapsed, start_s = 0, 0, 0.0
    context_now = sum(context for _, context in order)  # of order[first:], as they are now
    while first < len(order):
        size = len(order) - first
        context = context_now + size * elapsed
        step_s = fit.step_time_s(size, context)
        steps = order[first][0] - elapsed
        yield Segment(start_s, step_s, steps, size, context, elapsed, order, first)
        elapsed, start_s = elapsed + steps, start_s + steps * step_s
        while first < len(order) and order[first][0] <= elapsed:
            context_now -= order[first][1]
            first += 1
    yield Segment(start_s, 0.0, 0, 0, 0, elapsed, order, first)


def project(running: Sequence[RunningRequest], fit: DecodeStepFit, at_s: float) -> Batch:
    """The sequences still running `at_s` seconds from now, with their remaining and context tokens."""
    for segment in segments(running, fit):
        if segment.batch_size == 0:
            return ()
        if segment.start_s + segment.steps * segment.step_s <= at_s + _EPS_S:
            continue  # its next finisher is done by then (a zero step time always lands here)
        done = math.floor((at_s - segment.start_s + _EPS_S) / segment.step_s)
        return segment.batch(min(max(done, 0), segment.steps - 1))
    raise AssertionError("segments() always ends with an idle segment")


def step_time_with_s(batch: Batch, fit: DecodeStepFit, newcomer_context_tokens: int) -> float:
    """The step time (= TPOT of everyone in it) once a newcomer joins `batch`."""
    return fit.step_time_s(len(batch) + 1, sum(context for _, context in batch) + newcomer_context_tokens)


def time_until_step_within_s(
    running: Sequence[RunningRequest], fit: DecodeStepFit, newcomer_context_tokens: int, budget_s: float
) -> float | None:
    """The earliest moment (from now) a newcomer joining would see a step time within `budget_s`;
    None if not even an idle instance gets there."""
    for segment in segments(running, fit):
        step_s = fit.step_time_s(segment.batch_size + 1, segment.context_tokens + newcomer_context_tokens)
        if step_s <= budget_s:
            return segment.start_s
    return None


def time_until_blocks_free_s(
    running: Sequence[RunningRequest],
    fit: DecodeStepFit,
    blocks_free: int,
    blocks_total: int,
    block_size_tokens: int,
    blocks_needed: int,
) -> float | None:
    """The earliest moment (from now) at which `blocks_needed` KV blocks are free, as sequences finish
    and release theirs while the survivors grow into new ones; None if that never happens. Blocks in
    use by anything but the listed sequences (e.g. pinned during a hand-off) are assumed to stay.
    O(R) per segment (block counts round up per sequence); only rejections ask, and they stop early."""

    def held(segment: Segment) -> int:
        return sum(-(-context // block_size_tokens) for _, context in segment.batch())

    walk = segments(running, fit)
    now = next(walk)
    other_blocks = max(blocks_total - blocks_free - held(now), 0)
    for segment in (now, *walk):
        if blocks_total - other_blocks - held(segment) >= blocks_needed:
            return segment.start_s
    return None


def first_finish_s(running: Sequence[RunningRequest], fit: DecodeStepFit) -> float | None:
    """When the first running sequence is projected to finish; None when nothing runs."""
    first = next(segments(running, fit))
    return first.steps * first.step_s if first.batch_size else None
