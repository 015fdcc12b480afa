"""The `shared-prefix` workload: G groups x P prompts; the prompts of a group share one prefix.

Prompt (g, p) = prefix(g) + suffix(g, p), with prefix(g) the `prefix_len`-token block (SHARED_PREFIX, g)
and suffix(g, p) the `suffix_len`-token block (SHARED_SUFFIX, g * P + p) of `TokenSource`. Groups are
interleaved (request i is group i % G, member i // G), so consecutive requests hit different prefixes
and a router has to route by affinity, not by recency. Arrivals are Poisson at `rate_per_s`.

The notes carry `prefix_hit_rate_upper_bound`: what an infinite, single prefix cache could serve, i.e.
every request after its group's first reuses the whole KV blocks of its prefix, short of the prompt's
last token (which an engine always computes). The prompt length must fit the model with one output
token to spare; output lengths are clipped to what remains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from loadtest import tokens
from loadtest.arrivals import poisson_arrivals_s
from loadtest.lengths import LengthDist
from loadtest.plan import ModelLimits, Plan, RequestDefaults, make_requests, rate_note

_ARRIVALS, _OUTPUT_LENS = 1, 3


@dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int
    prompts_per_group: int
    prefix_len: int
    suffix_len: int
    output_len: LengthDist
    rate_per_s: float  # math.inf: all at once
    num_requests: int | None = None  # None: all groups x prompts_per_group; else the first N of them

    def __post_init__(self):
        for flag, value, low in (
            ("--groups", self.groups, 1),
            ("--prompts-per-group", self.prompts_per_group, 1),
            ("--prefix-len", self.prefix_len, 1),
            ("--suffix-len", self.suffix_len, 0),
        ):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        if not self.rate_per_s > 0:
            raise ValueError(f"--rate must be > 0 (or inf), got {self.rate_per_s}")
        if self.num_requests is not None and not 1 <= self.num_requests <= self.total:
            raise ValueError(
                f"--num-requests must be in [1, groups x prompts-per-group = {self.total}], got {self.num_requests}"
            )

    @property
    def total(self) -> int:
        return self.groups * self.prompts_per_group

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    def with_rate(self, rate_per_s: float) -> SharedPrefixSpec:
        return dataclasses.replace(self, rate_per_s=rate_per_s)

    def build(self, limits: ModelLimits, defaults: RequestDefaults, seed: int, salt: int = 0) -> Plan:
        """The plan; deterministic in (self, limits, defaults, seed, salt). ValueError when a prompt
        cannot fit the model (clipping would destroy the sharing under test)."""
        if self.prompt_len > limits.max_model_len - 1:
            raise ValueError(
                f"--prefix-len + --suffix-len = {self.prompt_len} leaves no room for output: "
                f"the model's max_model_len is {limits.max_model_len}"
            )
        n = self.num_requests or self.total
        source = tokens.TokenSource(limits, seed, salt)
        prefixes = source.blocks(tokens.SHARED_PREFIX, range(self.groups), self.prefix_len)
        group = np.arange(n) % self.groups
        member = np.arange(n) // self.groups
        suffixes = source.blocks(tokens.SHARED_SUFFIX, group * self.prompts_per_group + member, self.suffix_len)
        prompts = [np.concatenate([prefixes[g], suffix]).tolist() for g, suffix in zip(group, suffixes, strict=True)]
        raw_outputs = self.output_len.sample(np.random.default_rng([seed, _OUTPUT_LENS]), n)
        outputs = np.minimum(raw_outputs, limits.max_model_len - self.prompt_len)
        arrivals_s = poisson_arrivals_s(np.random.default_rng([seed, _ARRIVALS]), n, self.rate_per_s)
        return Plan(
            "shared-prefix",
            make_requests(arrivals_s, prompts, outputs, defaults),
            self._notes(n, limits, int(np.sum(outputs != raw_outputs))),
        )

    def _notes(self, n: int, limits: ModelLimits, clipped: int) -> dict:
        cacheable = min(self.prefix_len, self.prompt_len - 1) // limits.block_size * limits.block_size
        reusing = max(n - self.groups, 0)  # every request after its group's first
        return {
            "groups": self.groups,
            "prompts_per_group": self.prompts_per_group,
            "prefix_len": self.prefix_len,
            "suffix_len": self.suffix_len,
            "output_len": self.output_len.spelling,
            "rate_per_s": rate_note(self.rate_per_s),
            "requests_clipped": clipped,
            "prefix_hit_rate_upper_bound": reusing * cacheable / (n * self.prompt_len),
        }
