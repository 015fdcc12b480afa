"""Online cost models: how long prefill, decode steps and KV transfers take, fitted from step stats.

Four models, one fitter (`linear_fit.WindowedLinearFit`: the last `window_steps` samples, exact
non-negative least squares, unidentifiable terms held at their prior; refitted lazily on the first
read after new samples, ≈0.3 ms for 256 samples):

* prefill step: time_s = intercept_s + per_token_s · tokens + per_token_sq_s · tokens²
  The square term is attention's cost growing with the tokens each new token attends to; it is
  fitted only once the window holds at least three distinct step sizes (until then it stays at the
  prior, 0: attention is a small share of prefill for the prompt lengths a router sees most).
* decode step: time_s = intercept_s + per_request_s · batch_size + per_context_token_s · context
  (DistServe's shape: weights are read once per step, KV once per context token, plus per-sequence
  work). TPOT is this step time: every running sequence gains one token per step.
* KV transfer: time_s = latency_s + bytes / bandwidth (fitted as seconds per byte).
* observed TTFT: ttft_s = overhead_s + per_queued_token_s · tokens_through, fitted from the TTFTs the
  router itself saw, against the uncached tokens queued on the worker when the request was admitted
  (its own included). The step models see engine steps only; this one sees everything a request
  waits on around them: the router and Ray calls, the decode reservation, and a prefill worker whose
  KV pool is full of blocks pinned by hand-offs in flight, so that it computes one prompt per freed
  pool instead of full `budget`-token steps (measured on the 2-core test box: under a burst its
  steps held one prompt each, and its first tokens came at the hand-off rate, 2-4x slower than its
  step times alone said). Its prior is zero: until it has samples the step models decide alone.

Priors (used before `min_samples` samples, and for terms the window cannot identify) are an order
of magnitude for a 7B-class model on one datacenter GPU and a 10 GB/s link. They are deliberately
modest, so a cold router admits and learns rather than rejecting on a guess.

The router owns the models (it feeds them `observe`); admission reads immutable snapshots (`fit()`),
which is what `ClusterView` carries, so a decision never sees a model change under it.
"""

from __future__ import annotations

from typing import NamedTuple

from policies.admission.linear_fit import WindowedLinearFit
from policies.admission.step_stats import DecodeStep, PrefillStep, TransferStep, TtftSample, step_problem


class PrefillTimeFit(NamedTuple):
    intercept_s: float
    per_token_s: float
    per_token_sq_s: float

    def time_s(self, num_tokens: int) -> float:
        """One prefill step computing `num_tokens` tokens (0 tokens take no step and no time)."""
        if num_tokens <= 0:
            return 0.0
        return self.intercept_s + self.per_token_s * num_tokens + self.per_token_sq_s * num_tokens**2


class DecodeStepFit(NamedTuple):
    intercept_s: float
    per_request_s: float
    per_context_token_s: float

    def step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        """One decode step over `batch_size` sequences reading `total_context_tokens` of KV (0 if idle)."""
        if batch_size <= 0:
            return 0.0
        return self.intercept_s + self.per_request_s * batch_size + self.per_context_token_s * total_context_tokens


class TransferTimeFit(NamedTuple):
    latency_s: float
    per_byte_s: float

    def time_s(self, num_bytes: int) -> float:
        return self.latency_s + self.per_byte_s * num_bytes

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return float("inf") if self.per_byte_s == 0 else 1.0 / self.per_byte_s


class ObservedTtftFit(NamedTuple):
    overhead_s: float
    per_queued_token_s: float

    def time_s(self, tokens_through: int) -> float:
        """TTFT of a request admitted with `tokens_through` uncached tokens queued, its own included."""
        return self.overhead_s + self.per_queued_token_s * tokens_through


PREFILL_PRIOR = PrefillTimeFit(intercept_s=0.010, per_token_s=1e-4, per_token_sq_s=0.0)
DECODE_PRIOR = DecodeStepFit(intercept_s=0.015, per_request_s=2e-4, per_context_token_s=2.5e-7)
TRANSFER_PRIOR = TransferTimeFit(latency_s=0.001, per_byte_s=1e-10)
OBSERVED_TTFT_PRIOR = ObservedTtftFit(overhead_s=0.0, per_queued_token_s=0.0)
DEFAULT_WINDOW_STEPS = 256
DEFAULT_MIN_SAMPLES = 8


class _CostModel:
    """Shared plumbing: validate a sample, hand its features to the fitter, count what was dropped."""

    def __init__(self, prior: tuple, window_steps: int, min_samples: int):
        self._fit = WindowedLinearFit(prior, window_steps, min_samples)
        self.rejected_samples = 0

    @property
    def num_samples(self) -> int:
        return self._fit.num_samples

    def _add(self, step, features: tuple[float, ...]) -> bool:
        if step_problem(step) is not None:
            self.rejected_samples += 1
            return False
        self._fit.add(features, step.duration_s)
        return True

    def check_integrity(self) -> None:
        assert self.rejected_samples >= 0
        self._fit.check_integrity()


class PrefillCostModel(_CostModel):
    def __init__(
        self,
        prior: PrefillTimeFit = PREFILL_PRIOR,
        window_steps: int = DEFAULT_WINDOW_STEPS,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ):
        super().__init__(prior, window_steps, min_samples)

    def observe(self, step: PrefillStep) -> bool:
        """Adds a sample; False (and counted in `rejected_samples`) when it is unusable."""
        return self._add(step, (1.0, step.num_tokens, step.num_tokens**2))

    def fit(self) -> PrefillTimeFit:
        return PrefillTimeFit(*self._fit.coefficients())

    def prefill_time_s(self, num_tokens: int) -> float:
        return self.fit().time_s(num_tokens)


class DecodeCostModel(_CostModel):
    def __init__(
        self,
        prior: DecodeStepFit = DECODE_PRIOR,
        window_steps: int = DEFAULT_WINDOW_STEPS,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ):
        super().__init__(prior, window_steps, min_samples)

    def observe(self, step: DecodeStep) -> bool:
        return self._add(step, (1.0, step.batch_size, step.total_context_tokens))

    def fit(self) -> DecodeStepFit:
        return DecodeStepFit(*self._fit.coefficients())

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.fit().step_time_s(batch_size, total_context_tokens)


class TransferCostModel(_CostModel):
    def __init__(
        self,
        prior: TransferTimeFit = TRANSFER_PRIOR,
        window_steps: int = DEFAULT_WINDOW_STEPS,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ):
        super().__init__(prior, window_steps, min_samples)

    def observe(self, step: TransferStep) -> bool:
        return self._add(step, (1.0, step.num_bytes))

    def fit(self) -> TransferTimeFit:
        return TransferTimeFit(*self._fit.coefficients())

    def transfer_time_s(self, num_bytes: int) -> float:
        return self.fit().time_s(num_bytes)


class ObservedTtftModel(_CostModel):
    """Fitted by the router from its own admitted requests (`TtftSample`), not from worker reports."""

    def __init__(
        self,
        prior: ObservedTtftFit = OBSERVED_TTFT_PRIOR,
        window_steps: int = DEFAULT_WINDOW_STEPS,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ):
        super().__init__(prior, window_steps, min_samples)

    def observe(self, sample: TtftSample) -> bool:
        return self._add(sample, (1.0, sample.tokens_through))

    def fit(self) -> ObservedTtftFit:
        return ObservedTtftFit(*self._fit.coefficients())
