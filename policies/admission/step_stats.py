"""The step statistics workers report, which the admission cost models are fitted from.

Each sample is one measured unit of work, as small and flat as a process-boundary message should be:
* `PrefillStep`: one prefill engine step that computed `num_tokens` prompt tokens (all sequences of
  the step's batch together) in `duration_s` of wall time.
* `DecodeStep`: one decode engine step of `batch_size` sequences whose contexts (prompt + generated
  tokens, the KV the step's attention reads) add up to `total_context_tokens`.
* `TransferStep`: one KV hand-off that moved `num_bytes` from a prefill worker to a decode instance.
* `TtftSample`: one admitted request as the router saw it: `tokens_through` uncached prompt tokens
  were queued on its prefill worker when it was admitted (its own included), and its first token came
  `duration_s` after it reached the router. Not a worker report: the router measures it itself.

Samples come from other processes, so a bad one (a clock jump, a zero-length step) must not poison a
fit: `step_problem` names what is wrong and the cost models drop such samples and count them.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple


class PrefillStep(NamedTuple):
    num_tokens: int
    duration_s: float


class DecodeStep(NamedTuple):
    batch_size: int
    total_context_tokens: int
    duration_s: float


class TransferStep(NamedTuple):
    num_bytes: int
    duration_s: float


class TtftSample(NamedTuple):
    tokens_through: int
    duration_s: float


def step_problem(step: PrefillStep | DecodeStep | TransferStep | TtftSample) -> str | None:
    """Why `step` cannot be used for fitting, or None when it can."""
    if not (isinstance(step.duration_s, numbers.Real) and math.isfinite(step.duration_s) and step.duration_s > 0):
        return f"duration_s must be a finite number > 0, got {step.duration_s!r}"
    counts = {name: value for name, value in step._asdict().items() if name != "duration_s"}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            return f"{name} must be an integer >= 0, got {value!r}"
    if isinstance(step, DecodeStep) and step.batch_size < 1:
        return f"batch_size must be >= 1, got {step.batch_size}"
    if isinstance(step, PrefillStep) and step.num_tokens < 1:
        return f"num_tokens must be >= 1, got {step.num_tokens}"
    if isinstance(step, TtftSample) and step.tokens_through < 1:
        return f"tokens_through must be >= 1, got {step.tokens_through}"
    return None


def unseen_steps(stats, seen_index: int) -> list[tuple]:
    """The step records in a worker's `stats()` (common.messages.WorkerStats) newer than `seen_index`,
    oldest first. A record is (index, duration_s, num_tokens, num_seqs, context_tokens)
    (`engine.step_log.StepRecord`)."""
    return [record for record in stats.steps if record[0] > seen_index]
