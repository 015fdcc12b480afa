"""Poisson and shared-prefix workloads: deterministic, within the model's limits, shaped as specified."""
from __future__ import annotations

import math

import pytest

from loadtest.lengths import LengthDist
from loadtest.plan import ModelLimits, Plan, PlannedRequest, RequestDefaults, Slo
from loadtest.poisson import PoissonSpec
from loadtest.shared_prefix import SharedPrefixSpec
from tests.loadtest.helpers import LIMITS, all_tokens_valid

DEFAULTS = RequestDefaults(Slo(ttft_ms=500.0, tpot_ms=50.0), priority=3, tenant="t1")


def poisson(num_requests=40, rate=2.0, prompt="uniform:16,64", output="fixed:8") -> PoissonSpec:
    return PoissonSpec(num_requests, rate, LengthDist.parse(prompt), LengthDist.parse(output))


def test_poisson_is_deterministic_in_its_seed():
    plan = poisson().build(LIMITS, DEFAULTS, seed=1)
    assert plan == poisson().build(LIMITS, DEFAULTS, seed=1)
    assert plan != poisson().build(LIMITS, DEFAULTS, seed=2)
    assert [r.index for r in plan.requests] == list(range(40))
    assert all(r.slo == Slo(500.0, 50.0) and r.priority == 3 and r.tenant == "t1" for r in plan.requests)
    assert all(16 <= r.num_prompt_tokens <= 64 and r.max_tokens == 8 for r in plan.requests)
    assert all_tokens_valid(plan)
    assert len({r.prompt_token_ids for r in plan.requests}) == 40


def test_poisson_rate_moves_only_arrivals_and_salt_only_tokens():
    base = poisson(rate=1.0).build(LIMITS, DEFAULTS, seed=1)
    faster = poisson(rate=1.0).with_rate(4.0).build(LIMITS, DEFAULTS, seed=1)
    salted = poisson(rate=1.0).build(LIMITS, DEFAULTS, seed=1, salt=1)
    assert [r.arrival_s / 4.0 for r in base.requests] == pytest.approx([r.arrival_s for r in faster.requests])
    assert [r.prompt_token_ids for r in base.requests] == [r.prompt_token_ids for r in faster.requests]
    assert [(r.arrival_s, r.num_prompt_tokens, r.max_tokens) for r in base.requests] == \
        [(r.arrival_s, r.num_prompt_tokens, r.max_tokens) for r in salted.requests]
    assert all(a.prompt_token_ids != b.prompt_token_ids for a, b in zip(base.requests, salted.requests))


def test_poisson_clips_lengths_to_the_model_and_counts_them():
    plan = poisson(num_requests=5, prompt="fixed:600", output="fixed:100").build(LIMITS, DEFAULTS, seed=0)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in plan.requests] == [(511, 1)] * 5
    assert plan.notes["requests_clipped"] == 5
    plan = poisson(num_requests=5, prompt="fixed:500", output="fixed:10").build(LIMITS, DEFAULTS, seed=0)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in plan.requests] == [(500, 10)] * 5
    assert plan.notes["requests_clipped"] == 0


def test_poisson_infinite_rate_is_one_burst():
    plan = poisson(num_requests=4, rate=math.inf).build(LIMITS, DEFAULTS, seed=0)
    assert [r.arrival_s for r in plan.requests] == [0.0] * 4
    assert plan.notes["rate_per_s"] == "inf"


def test_specs_reject_bad_values_naming_the_flag():
    with pytest.raises(ValueError, match="--num-requests"):
        poisson(num_requests=0)
    with pytest.raises(ValueError, match="--rate"):
        poisson(rate=0.0)
    with pytest.raises(ValueError, match="--suffix-len"):
        SharedPrefixSpec(2, 2, 8, -1, LengthDist.parse("fixed:4"), 1.0)
    with pytest.raises(ValueError, match=r"--num-requests must be in \[1, groups x prompts-per-group = 4\]"):
        SharedPrefixSpec(2, 2, 8, 1, LengthDist.parse("fixed:4"), 1.0, num_requests=5)


def shared(groups=3, per_group=4, prefix=40, suffix=5, output="fixed:6", num_requests=None) -> SharedPrefixSpec:
    return SharedPrefixSpec(groups, per_group, prefix, suffix, LengthDist.parse(output), math.inf, num_requests)


def test_shared_prefix_interleaves_groups_that_share_exactly_their_prefix():
    plan = shared().build(LIMITS, DEFAULTS, seed=9)
    assert plan == shared().build(LIMITS, DEFAULTS, seed=9)
    assert all_tokens_valid(plan)
    prompts = [r.prompt_token_ids for r in plan.requests]
    assert len(prompts) == 12 and all(len(p) == 45 for p in prompts)
    for i, prompt in enumerate(prompts):
        group_first = prompts[i % 3]  # requests 0, 1, 2 open groups 0, 1, 2; then they repeat in turn
        assert prompt[:40] == group_first[:40]
    assert len({p[:40] for p in prompts}) == 3
    assert len({p[40:] for p in prompts}) == 12
    assert all(r.max_tokens == 6 for r in plan.requests)


def test_shared_prefix_upper_bound_counts_whole_blocks_after_each_groups_first():
    plan = shared().build(LIMITS, DEFAULTS, seed=0)
    # 40-token prefix -> 2 whole 16-token blocks; 9 of 12 requests reuse them; 12 x 45 prompt tokens
    assert plan.notes["prefix_hit_rate_upper_bound"] == 9 * 32 / (12 * 45)
    no_suffix = shared(prefix=32, suffix=0).build(LIMITS, DEFAULTS, seed=0)
    # the prompt's last token is always computed, so of a block-aligned 32-token prompt only 16 can hit
    assert no_suffix.notes["prefix_hit_rate_upper_bound"] == 9 * 16 / (12 * 32)


def test_shared_prefix_truncates_and_fits_outputs_but_refuses_an_unfittable_prompt():
    plan = shared(num_requests=5, prefix=500, suffix=6, output="fixed:20").build(LIMITS, DEFAULTS, seed=0)
    assert [r.max_tokens for r in plan.requests] == [6] * 5
    assert plan.notes["requests_clipped"] == 5
    with pytest.raises(ValueError, match="leaves no room for output"):
        shared(prefix=500, suffix=12).build(LIMITS, DEFAULTS, seed=0)


def test_a_plan_must_be_in_arrival_order():
    late, early = PlannedRequest(0, 2.0, (1,), 1), PlannedRequest(1, 1.0, (1,), 1)
    with pytest.raises(ValueError, match="arrival order"):
        Plan("x", (late, early))


def test_limits_come_from_the_sdk_model_info():
    from splitserve_client.sdk_types import ModelInfo

    info = ModelInfo("m", 1024, 500, 32, "blake2b-128/v1/u32le", (1, 2), True)
    assert ModelLimits.from_model_info(info) == ModelLimits(1024, 500, 32, (1, 2))
