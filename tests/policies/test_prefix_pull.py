"""The prefix-pull decision: exact choices from the prior, from fitted models, and every reason not to pull."""

from __future__ import annotations

import pytest

from common.messages import PrefixPull, PullOutcome, WorkerStats
from engine.step_log import StepRecord
from policies.prefix_pull import PullPlanner
from policies.routing import RouteDecision, RouteQuery

BLOCK = 16
KV_BYTES_PER_TOKEN = 1000


def _query(num_tokens: int) -> RouteQuery:
    return RouteQuery(tuple(bytes([i]) * 16 for i in range(num_tokens // BLOCK)), num_tokens, BLOCK, b"k")


def _planner(mode: str = "auto") -> PullPlanner:
    return PullPlanner(mode, KV_BYTES_PER_TOKEN)


def test_no_pull_without_a_better_healthy_holder():
    planner = _planner("always")
    query = _query(200)
    assert _planner("never").plan(query, RouteDecision("p1", 0, "p0", 4), {"p0", "p1"}) is None
    assert planner.plan(query, RouteDecision("p1", 0), {"p0", "p1"}) is None  # the policy knows no holder
    assert planner.plan(query, RouteDecision("p0", 4, "p0", 4), {"p0", "p1"}) is None  # chosen = holder
    assert planner.plan(query, RouteDecision("p1", 4, "p0", 4), {"p0", "p1"}) is None  # nothing missing
    assert planner.plan(query, RouteDecision("p1", 0, "p0", 4), {"p1"}) is None  # holder unhealthy


def test_always_pulls_what_the_holder_has_but_never_the_last_token():
    planner = _planner("always")
    assert planner.plan(_query(200), RouteDecision("p1", 1, "p0", 4), {"p0", "p1"}) == PrefixPull("p0", 4)
    # 64 tokens = 4 full blocks, but the last token is always computed: at most 3 blocks come from cache
    assert planner.plan(_query(64), RouteDecision("p1", 0, "p0", 4), {"p0", "p1"}) == PrefixPull("p0", 3)


def test_auto_pulls_only_when_the_transfer_beats_recomputing():
    planner = _planner()
    # prior: pull_s = 20 ms + bytes x 2 ns; prefill_s = 10 ms + 0.1 ms per token
    # 13 blocks: pull 20 ms + 208,000 B x 2 ns = 20.416 ms < saved 208 tokens x 0.1 ms = 20.8 ms → pull
    assert planner.pull_s(13, BLOCK) == pytest.approx(0.020416)
    assert planner.saved_s(_query(300), 0, 13) == pytest.approx(0.0208)
    assert planner.plan(_query(300), RouteDecision("p1", 0, "p0", 13), {"p0", "p1"}) == PrefixPull("p0", 13)
    # 12 blocks: 20.384 ms > 19.2 ms saved → compute
    assert planner.plan(_query(300), RouteDecision("p1", 0, "p0", 12), {"p0", "p1"}) is None


def _stats(steps) -> WorkerStats:
    return WorkerStats(0, 0, 10, 10, tuple(StepRecord(*step) for step in steps))


def test_fitted_models_replace_the_priors():
    planner = _planner()
    steps = [(i + 1, 0.001 + 0.00001 * tokens, tokens, 1, tokens) for i, tokens in enumerate(range(50, 450, 40))]
    planner.observe_stats("p0", "prefill", 1, _stats(steps))
    planner.observe_stats("decode-0", "decode", 1, _stats([(1, 5.0, 1, 1, 100)]))  # decode steps are not prefill's
    assert planner.prefill_cost.num_samples == len(steps)
    assert planner.saved_s(_query(200), 0, 4) == pytest.approx(64 * 0.00001, rel=1e-6)
    # Slow pulls observed (50 ms + 1 us per KB): a 4-block pull no longer pays.
    for num_blocks in range(1, 11):
        num_bytes = num_blocks * BLOCK * KV_BYTES_PER_TOKEN
        planner.observe_pull(PullOutcome(num_blocks, num_bytes, 0.05 + num_bytes * 1e-9))
    planner.observe_pull(PullOutcome(0, 0, 0.2, "failed"))  # carries no transfer timing
    assert planner.pull_cost.num_samples == 10
    assert planner.pull_s(4, BLOCK) == pytest.approx(0.05 + 64_000e-9, rel=1e-6)
    assert planner.plan(_query(200), RouteDecision("p1", 0, "p0", 4), {"p0", "p1"}) is None


def test_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown prefix pull mode 'sometimes'; known: auto, always, never"):
        PullPlanner("sometimes", KV_BYTES_PER_TOKEN)


def test_a_prefill_model_fed_elsewhere_is_shared_not_copied():
    from policies.admission import PrefillCostModel, PrefillStep

    model = PrefillCostModel(min_samples=2)
    planner = PullPlanner("auto", KV_BYTES_PER_TOKEN, prefill_cost=model)
    for tokens in (100, 200, 300):
        model.observe(PrefillStep(tokens, 0.001 + 0.00001 * tokens))  # the admission gate feeds it
    assert planner.saved_s(_query(200), 0, 4) == pytest.approx(64 * 0.00001, rel=1e-6)
