"""The adaptive off-switch: speculate on a step only while it is measured to be cheaper per token.

Speculation trades compute for tokens: a speculative step costs the proposal plus a verify forward over
1 + k tokens per sequence and yields 1 + (accepted drafts) tokens per sequence. While decoding is
memory-bound (small batches) the verify forward costs about what a one-token step costs, so every
accepted draft is nearly free; once the batch is large enough to be compute-bound, or acceptance is low,
it costs more per token than plain decoding and must stop.

The rule, decided before each step from measured costs:
- A cost sample is one pure decode step (no prompt chunk in it, which would swamp the figure): its wall
  time, the tokens its decoding sequences emitted and, for a speculative step, the most it could have
  emitted (every draft accepted). A speculative step in which no sequence got a draft is a plain sample
  (that is what it cost). A step in which the draft model caught up KV it lacked (a new prompt, steps
  run without speculation) is a speculative sample marked `catch_up`: speculating is what made the
  draft compute that KV, and plain decoding never pays it (measured on CPU with a draft that agrees
  90% of the time: leaving it out let a 64-sequence batch pay the draft's prompt KV of every request
  and run at 0.77x of plain). It counts in the mode's cost, never as an outlier, but not in the
  per-step judgements below (hopeless, a probe's early stop): those are about what a step costs once
  the draft is level.
- Samples are kept per batch-size bucket (decoding sequences: 1, 2-3, 4-7, 8-15, ...), the last
  `WINDOW` of each mode; a mode's cost is its window's seconds over its tokens, leaving out the slowest
  step other than a catch-up once there are 3 or more (one step stalled by a busy host must not decide
  anything). Seconds over tokens, not a median of per-step ratios: acceptance is lumpy (a step accepts
  all k drafts or none), and a median of ratios would judge by the typical step, not by what the tokens
  cost.
- A bucket first runs `PROBE_STEPS` plain steps, then `PROBE_STEPS` speculative ones; from then on it
  speculates iff its speculative cost per token is below its plain cost. Speculation is *hopeless* in
  a bucket when, at the acceptance rate measured so far, its tokens would cost more than plain ones: a
  speculative step's seconds over (its sequences + its drafts x the rate) is at least the plain cost
  per token. The rate is accepted over drafted tokens of the last `RATE_SAMPLES` speculative samples
  of every bucket (acceptance is a property of the draft and the text, not of the batch size), taken
  as 1 until `MIN_RATE_DRAFTS` drafts have been judged: then hopeless means "even at full acceptance",
  true of compute-bound batches. One sample shows it, so the first probe stops there. A step with a
  prompt chunk due cannot be a sample: it speculates only if its bucket has measured speculation
  cheaper.
- The losing mode is re-measured for `PROBE_STEPS` steps once every `probe_interval` steps of the
  bucket (acceptance and batch shape drift); a speculative probe stops at a hopeless sample (not at its
  catch-up step). A probe
  that confirms the decision doubles the interval (up to `MAX_PROBE_INTERVAL`), a flip resets it. A
  probe costs its steps' extra time over the winning mode plus, for a draft model, its catch-up step,
  so the interval is also at least what keeps that extra under `PROBE_TIME_SHARE` of the bucket's
  time: (probe steps x (loser's cost / winner's cost - 1) + catch-up step / plain step) /
  PROBE_TIME_SHARE steps, the first term counted once both windows are full (a hopeless bucket, on 2
  samples: one probe step's time beyond what its tokens cost at the plain rate), the catch-up from its
  first measurement.
  A draft that makes steps 8x dearer per token is re-tried every ~1,000 steps, not every 16 (measured:
  at every 16-256 steps such probes alone cost a 64-sequence batch 40% of its TPOT on the H100).
- A catch-up step's cost is amortised over the tokens the caught-up sequences are expected to produce
  after it, and a stalled one is charged what its tokens usually cost: engine/speculative/catch_up.py.
  Amortised catch-ups stay out of the window; their cost per token (`surcharge`) is added to the
  window's speculative cost.

Acceptance enters through the measured cost (fewer accepted tokens, more seconds per token). Nothing
here reads a clock: the engine reports each step's duration (`observe`), so the rule is tested with
exact figures.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.speculative.catch_up import CatchUps

WINDOW = 8
PROBE_STEPS = 3
FIRST_PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 2048
PROBE_TIME_SHARE = 0.02
RATE_SAMPLES = 64
MIN_RATE_DRAFTS = 64


class Sample(NamedTuple):
    """One measured decode step: its wall time and the tokens it emitted; for a speculative step also
    its decoding sequences, its drafts (None: not known) and whether the draft caught up KV in it."""

    seconds: float
    tokens: int
    sequences: int = 0
    drafts: int | None = None
    catch_up: bool = False


@dataclass
class _Bucket:
    spec_s: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # Samples of speculative steps
    plain_s: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # Samples of plain steps
    catch_up_s: float = 0.0  # the last step in which the draft caught up KV it lacked (as charged)
    catch_ups: CatchUps = field(default_factory=CatchUps)
    steps_since_probe: int = 0
    probe_interval: int = FIRST_PROBE_INTERVAL
    probe_left: int = 0  # steps of the current probe still to run
    decided_before_probe: bool | None = None
    # Steps since the last probe before the next may start: the probe budget, worked out when the
    # interval is reached and again only when this count is (O(1) per step in between).
    probe_at: int = 0
    _spec_cost_s: float | None = None  # spec_cost() until a speculative sample or catch-up arrives

    def add_spec(self, sample: Sample) -> None:
        self.spec_s.append(sample)
        self._spec_cost_s = None

    def level_s(self) -> float:
        """A level speculative step's seconds: the mean of the window's non-catch-up samples (0: none)."""
        level = [sample.seconds for sample in self.spec_s if not sample.catch_up]
        return sum(level) / len(level) if level else 0.0

    def charge_catch_up(self, duration_s: float, tokens: int, tokens_ahead: int) -> float:
        self._spec_cost_s = None
        return self.catch_ups.charge(duration_s, tokens, tokens_ahead, self.level_s())

    def spec_cost(self) -> float:
        """Speculation's seconds per token: the window's, plus the amortised catch-ups' surcharge
        (cached: a step that does not speculate leaves both unchanged)."""
        if self._spec_cost_s is None:
            surcharge_s = self.catch_ups.surcharge_s(self.level_s()) or 0.0
            self._spec_cost_s = seconds_per_token(self.spec_s) + surcharge_s
        return self._spec_cost_s

    def better(self) -> bool | None:
        """Whether speculation is measured cheaper; None until both modes have samples."""
        if not self.spec_s or not self.plain_s:
            return None
        return self.spec_cost() < seconds_per_token(self.plain_s)


def seconds_per_token(samples: deque) -> float:
    """A window's seconds over its tokens, without its slowest step (a catch-up step is no outlier: it
    is a cost) once it has 3 or more steps."""
    kept = list(samples)
    ordinary = [sample for sample in kept if not sample.catch_up]
    if len(kept) >= 3 and ordinary:  # the slowest by duration; among equal ones, the fewest tokens
        kept.remove(max(ordinary, key=lambda sample: (sample.seconds, -sample.tokens)))
    return sum(sample.seconds for sample in kept) / sum(sample.tokens for sample in kept)


def _plain_step_s(bucket: _Bucket) -> float:
    return sum(sample.seconds for sample in bucket.plain_s) / len(bucket.plain_s)


def _budget_interval(bucket: _Bucket, hopeless: bool) -> int:
    """Fewest steps between probes that keep a probe's extra time under PROBE_TIME_SHARE. The probe's
    steps count once both windows are full or speculation is hopeless on 2 samples (a few early
    samples must not space the probes out); the draft's catch-up counts from its first measurement: it
    is the dearest part of a probe (the whole batch's prompts after a round of new requests: ~10 plain
    steps at batch 64 on CPU), and doubling alone would pay it at 16, 48 and 112 steps."""
    plain = seconds_per_token(bucket.plain_s) if bucket.plain_s else 0.0
    # A probe's steps are priced level (the draft caught up); its catch-up step is added once below.
    level = deque(sample for sample in bucket.spec_s if not sample.catch_up) or bucket.spec_s
    if len(bucket.spec_s) >= WINDOW and len(bucket.plain_s) >= WINDOW:
        spec = seconds_per_token(level)
        probe_steps = PROBE_STEPS * (max(spec, plain) / max(min(spec, plain), 1e-12) - 1)
    elif hopeless:  # a speculative probe stops at its first (hopeless) sample
        spec_step_s = sum(sample.seconds for sample in level) / len(level)
        spec_tokens = sum(sample.tokens for sample in level) / len(level)
        probe_steps = max(spec_step_s - spec_tokens * plain, 0.0) / max(_plain_step_s(bucket), 1e-12)
    else:
        probe_steps = 0.0
    if bucket.better() is False and bucket.catch_up_s > 0:
        probe_steps += max(bucket.catch_up_s / max(_plain_step_s(bucket), 1e-12) - 1, 0.0)
    return min(MAX_PROBE_INTERVAL, math.ceil(probe_steps / PROBE_TIME_SHARE))


class AdaptiveSwitch:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._buckets: dict[int, _Bucket] = {}
        self._judged: deque = deque(maxlen=RATE_SAMPLES)  # (accepted, drafted) of speculative samples

    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens lately, across buckets; 1 until MIN_RATE_DRAFTS were judged."""
        drafted = sum(d for _, d in self._judged)
        return sum(a for a, _ in self._judged) / drafted if drafted >= MIN_RATE_DRAFTS else 1.0

    def _hopeless(self, bucket: _Bucket, min_samples: int = 1) -> bool:
        """Whether speculation costs more per token than plain decoding at the measured acceptance rate,
        on the cheapest of at least `min_samples` speculative samples that know their drafts."""
        known = [sample for sample in bucket.spec_s if sample.drafts is not None and not sample.catch_up]
        if len(known) < min_samples or len(bucket.plain_s) < PROBE_STEPS:
            return False
        return min(self._expected_s(sample) for sample in known) >= seconds_per_token(bucket.plain_s)

    def _expected_s(self, sample: Sample) -> float:
        """A speculative sample's seconds per token had it accepted drafts at the measured rate."""
        assert sample.drafts is not None
        return sample.seconds / (sample.sequences + sample.drafts * self.acceptance_rate())

    @staticmethod
    def bucket_of(num_decoding: int) -> int:
        return max(num_decoding, 1).bit_length()

    def decide(self, num_decoding: int, measurable: bool = True) -> bool:
        """Whether the next step with `num_decoding` decoding sequences speculates. `measurable`: no
        prompt chunk is due, so the step can be a cost sample; a step that cannot be measured
        speculates only where speculation is already measured cheaper (a probe there would cost
        without teaching anything: ramp-ups of a batch are all such steps)."""
        if not self.enabled:
            return True
        bucket = self._bucket(num_decoding)
        if not measurable:
            return bucket.better() is True
        if len(bucket.plain_s) < PROBE_STEPS:
            return False
        if len(bucket.spec_s) < PROBE_STEPS and not self._hopeless(bucket):
            return True
        if bucket.probe_left:
            bucket.probe_left -= 1
            return not bucket.decided_before_probe
        if bucket.decided_before_probe is not None:  # a probe's steps have all been measured: judge it
            self._end_probe(bucket)
        better = bucket.better()
        assert better is not None, "both modes have samples here"
        bucket.steps_since_probe += 1
        if bucket.steps_since_probe < max(bucket.probe_interval, bucket.probe_at):
            return better
        # The interval is reached: the budget is worked out now, and again when its count is reached
        # (costs drift between), not on every step in between.
        bucket.probe_at = _budget_interval(bucket, self._hopeless(bucket, 2))
        if bucket.steps_since_probe >= bucket.probe_at:
            bucket.steps_since_probe, bucket.probe_left, bucket.decided_before_probe = 0, PROBE_STEPS - 1, better
            bucket.probe_at = 0
            return not better
        return better

    def observe(
        self,
        speculated: bool,
        num_decoding: int,
        duration_s: float,
        num_output_tokens: int,
        most_tokens: int | None = None,
        catch_up: bool = False,
        catch_up_tokens: int = 0,
        tokens_ahead: int = 0,
    ) -> None:
        """A pure decode step ran: `speculated` (some sequence had drafts) or not, its wall time, the
        tokens it emitted and, if it speculated, the most it could have (None: not known). `catch_up`:
        the draft caught up KV it lacked in it (a speculative step's cost, whether or not any sequence
        got drafts), `catch_up_tokens` of it, for sequences expected to emit `tokens_ahead` more tokens
        (0: not known; catch_up.py)."""
        if not self.enabled or num_output_tokens <= 0:
            return
        bucket = self._bucket(num_decoding)
        if catch_up:
            duration_s = bucket.charge_catch_up(duration_s, catch_up_tokens, tokens_ahead)
            bucket.catch_up_s = duration_s
        elif not speculated:
            bucket.plain_s.append(Sample(duration_s, num_output_tokens))
            return
        drafts = max(most_tokens - num_decoding, 0) if speculated and most_tokens else None
        sample = Sample(duration_s, num_output_tokens, num_decoding, drafts, catch_up)
        if drafts is not None:
            self._judged.append((min(max(num_output_tokens - num_decoding, 0), drafts), drafts))
        if catch_up and tokens_ahead > 0 and catch_up_tokens > 0:
            return  # amortised: its cost reaches the window as the surcharge
        bucket.add_spec(sample)
        if drafts is None:
            return
        probing_speculation = bucket.probe_left and bucket.decided_before_probe is False
        if catch_up or not probing_speculation:
            return
        if self._expected_s(sample) >= seconds_per_token(bucket.plain_s):
            bucket.probe_left = 0  # this sample alone shows it cannot win: the rest of the probe would not

    def costs(self, num_decoding: int) -> tuple[float | None, float | None]:
        """(speculative, plain) seconds per output token of this batch size's bucket (see the rule)."""
        bucket = self._bucket(num_decoding)
        return (
            bucket.spec_cost() if bucket.spec_s else None,
            seconds_per_token(bucket.plain_s) if bucket.plain_s else None,
        )

    def _bucket(self, num_decoding: int) -> _Bucket:
        key = self.bucket_of(num_decoding)
        bucket = self._buckets.get(key)  # not setdefault: a new _Bucket per call costs microseconds
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket

    @staticmethod
    def _end_probe(bucket: _Bucket) -> None:
        flipped = bucket.better() != bucket.decided_before_probe
        bucket.probe_interval = FIRST_PROBE_INTERVAL if flipped else min(bucket.probe_interval * 2, MAX_PROBE_INTERVAL)
        bucket.decided_before_probe = None
