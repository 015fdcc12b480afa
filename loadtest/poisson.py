"""The `poisson` workload: independent random prompts arriving as a Poisson process.

Arrivals, prompt lengths and output lengths each come from their own generator seeded with
(seed, purpose), so changing the rate moves only the arrivals and changing a length distribution moves
only that column. Lengths are clipped to the model (`lengths.fit_lengths`); the notes count how many
were clipped. Prompt tokens come from `TokenSource` stream POISSON_PROMPT keyed by request index:
prompts share no prefix beyond chance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from loadtest import tokens
from loadtest.arrivals import poisson_arrivals_s
from loadtest.lengths import LengthDist, fit_lengths
from loadtest.plan import ModelLimits, Plan, RequestDefaults, make_requests, rate_note

_ARRIVALS, _PROMPT_LENS, _OUTPUT_LENS = 1, 2, 3


@dataclass(frozen=True)
class PoissonSpec:
    num_requests: int
    rate_per_s: float  # math.inf: all at once
    prompt_len: LengthDist
    output_len: LengthDist

    def __post_init__(self):
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if not self.rate_per_s > 0:
            raise ValueError(f"--rate must be > 0 (or inf), got {self.rate_per_s}")

    def with_rate(self, rate_per_s: float) -> PoissonSpec:
        return dataclasses.replace(self, rate_per_s=rate_per_s)

    def build(self, limits: ModelLimits, defaults: RequestDefaults, seed: int, salt: int = 0) -> Plan:
        """The plan; deterministic in (self, limits, defaults, seed, salt)."""
        n = self.num_requests
        arrivals_s = poisson_arrivals_s(np.random.default_rng([seed, _ARRIVALS]), n, self.rate_per_s)
        raw_prompts = self.prompt_len.sample(np.random.default_rng([seed, _PROMPT_LENS]), n)
        raw_outputs = self.output_len.sample(np.random.default_rng([seed, _OUTPUT_LENS]), n)
        prompt_lens, output_lens = fit_lengths(raw_prompts, raw_outputs, limits.max_model_len)
        source = tokens.TokenSource(limits, seed, salt)
        prompts = [
            source.blocks(tokens.POISSON_PROMPT, [i], int(length))[0].tolist() for i, length in enumerate(prompt_lens)
        ]
        notes = {
            "rate_per_s": rate_note(self.rate_per_s),
            "prompt_len": self.prompt_len.spelling,
            "output_len": self.output_len.spelling,
            "requests_clipped": int(np.sum((prompt_lens != raw_prompts) | (output_lens != raw_outputs))),
        }
        return Plan("poisson", make_requests(arrivals_s, prompts, output_lens, defaults), notes)
