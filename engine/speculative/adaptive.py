"""The adaptive off-switch: speculate on a step only while it is measured to be cheaper per token.

Speculation trades compute for tokens: a speculative step costs the proposal plus a verify forward over
1 + k tokens per sequence and yields 1 + (accepted drafts) tokens per sequence. While decoding is
memory-bound (small batches) the verify forward costs about what a one-token step costs, so every
accepted draft is nearly free; once the batch is large enough to be compute-bound, or acceptance is low,
it costs more per token than plain decoding and must stop.

The rule, decided before each step from measured costs:
- Costs are kept per batch-size bucket (decoding sequences: 1, 2-3, 4-7, 8-15, ...), as an exponential
  moving average (weight `EWMA_WEIGHT` for the newest) of *seconds per output token* of pure decode steps
  (no prompt chunk in them, which would swamp the figure): the step's wall time divided by the tokens
  its decoding sequences emitted. Speculative and plain steps have one average each.
- A bucket that has never measured speculation speculates; one that has never measured plain decoding
  then runs plain. After that it speculates iff its speculative cost per token is below its plain cost.
- The losing mode is re-measured once every `probe_interval` steps of the bucket (acceptance and batch
  shape drift). Each probe that confirms the decision doubles the interval (up to `MAX_PROBE_INTERVAL`),
  a flip resets it, so a settled bucket spends under 1/128 of its steps on the slower mode.

Acceptance enters through the measured cost (fewer accepted tokens, more seconds per token). Nothing
here reads a clock: the engine reports each step's duration (`observe`), so the rule is tested with
exact figures.
"""
from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.3
FIRST_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 128


@dataclass
class _Bucket:
    spec_s_per_token: float | None = None
    plain_s_per_token: float | None = None
    steps_since_probe: int = 0
    probe_interval: int = FIRST_PROBE_INTERVAL
    probing: bool = False


class AdaptiveSwitch:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_decoding: int) -> int:
        return max(num_decoding, 1).bit_length()

    def decide(self, num_decoding: int) -> bool:
        """Whether the next step with `num_decoding` decoding sequences speculates."""
        if not self.enabled:
            return True
        bucket = self._buckets.setdefault(self.bucket_of(num_decoding), _Bucket())
        bucket.probing = False
        if bucket.spec_s_per_token is None:
            return True
        if bucket.plain_s_per_token is None:
            return False
        better = bucket.spec_s_per_token < bucket.plain_s_per_token
        bucket.steps_since_probe += 1
        if bucket.steps_since_probe >= bucket.probe_interval:
            bucket.steps_since_probe, bucket.probing = 0, True
            return not better
        return better

    def observe(self, speculated: bool, num_decoding: int, duration_s: float, num_output_tokens: int) -> None:
        """A pure decode step ran: `speculated` or not, its wall time and the tokens it emitted."""
        if not self.enabled or num_output_tokens <= 0:
            return
        bucket = self._buckets.setdefault(self.bucket_of(num_decoding), _Bucket())
        before = self._better(bucket)
        cost = duration_s / num_output_tokens
        name = "spec_s_per_token" if speculated else "plain_s_per_token"
        old = getattr(bucket, name)
        setattr(bucket, name, cost if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * cost)
        if bucket.probing:
            after = self._better(bucket)
            flipped = before is not None and after is not None and before != after
            bucket.probe_interval = (FIRST_PROBE_INTERVAL if flipped
                                     else min(bucket.probe_interval * 2, MAX_PROBE_INTERVAL))
            bucket.probing = False

    def costs(self, num_decoding: int) -> tuple[float | None, float | None]:
        """(speculative, plain) seconds per output token measured for this batch size's bucket."""
        bucket = self._buckets.get(self.bucket_of(num_decoding), _Bucket())
        return bucket.spec_s_per_token, bucket.plain_s_per_token

    @staticmethod
    def _better(bucket: _Bucket) -> bool | None:
        if bucket.spec_s_per_token is None or bucket.plain_s_per_token is None:
            return None
        return bucket.spec_s_per_token < bucket.plain_s_per_token
