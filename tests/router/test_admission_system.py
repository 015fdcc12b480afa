"""Admission control on a real small cluster with a tight TTFT SLO: a burst is answered with early
RESOURCE_EXHAUSTED rejections (reason + retry-after) instead of queueing past the SLO, the requests it
admits meet their SLO, the same burst with admission off misses it for most, lower priorities are shed
first, and no block is left reserved. Bursts come from a client process of their own (`burst_client`),
as they would in production, and TTFT is what that client saw.

Timing on a shared 2-core box: the SLO is not a constant but the median TTFT of a warm-up burst of the
same prompts measured in the same test, so it means "room for about half of a 24-prompt burst" on a
fast machine and on a slow one alike.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import replace

import pytest

from engine.heap import freeze_startup_heap
from policies.admission import AdmissionConfig, AlwaysAdmitPolicy
from tests.factories import TinySpec, random_prompts
from tests.router.burst_client import burst
from tests.router.conftest import router_config, start_router

BURST = 80
WARM_UP = 24
# Admitted requests allowed to miss the SLO: one per ten admitted, and at least one. Not none: on this
# machine one engine step in a few hundred stalls for ~0.3 s (another process holds the core), which no
# prediction made before the burst can foresee; a burst admits ~8-12, so this allows one such late
# request and still fails if the predictions run short (with the step models alone: 12-88% met in 4
# runs). A share alone (90% of 8 = 7.2) would have allowed none.
LATE_PER_TEN_ADMITTED = 1


@pytest.fixture(scope="module")
def admitting(ray_session, checkpoint):
    config = router_config()
    # slo_margin 0.75 (default 0.9): the router shares this process and the machine's two cores with the
    # workers, so turning away the burst's tail delays the first tokens of the requests it admitted
    # (10 of 11 admitted came in 9-33% over a 0.9 budget on a slower CI machine). The margin is the
    # product's knob for exactly this error; the test still fails if predictions run short by more.
    admission = AdmissionConfig(
        policy="predictive",
        default_tpot_ms=10_000.0,
        cost_min_samples=4,
        shed_step_per_priority=0.3,
        slo_margin=0.75,
    )
    config = replace(config, admission=admission, decode=replace(config.decode, num_kv_blocks=4096))
    stack = start_router(checkpoint(TinySpec()), config)
    # The router runs in this pytest process, whose heap holds ~0.5 M objects by this point of the suite:
    # a full collection during a burst paused it for 250-370 ms (every first token late at once). A
    # router process of its own freezes its startup heap (`splitserve serve`); so does this one.
    freeze_startup_heap()
    yield stack
    gc.unfreeze()
    stack.stop()


def _prompts(n: int, seed: int) -> list[list[int]]:
    # A fresh seed per burst: random prompts share no prefix block, so no burst hits another's cache.
    return random_prompts(n, 400, 480, 512, seed=seed)


def _warm_up(stack, seed: int) -> float:
    """A burst of the test's prompts under an SLO nobody misses, so the step models (from the worker's
    reports, probed right after) and the router's observed-TTFT model have seen queues as long as the
    test's. Returns the test's TTFT SLO (ms): the median TTFT this burst saw."""
    ttfts_s = [r.ttft_s for r in burst(stack.target, _prompts(WARM_UP, seed), [0] * WARM_UP, 60_000.0)]
    stack.loop.call(stack.server.service.monitor.probe_all())
    return statistics.median(ttfts_s) * 1000.0


def _admitted_ttfts_s(results) -> list[float]:
    return [r.ttft_s for r in results if not r.rejected]


def test_a_burst_is_rejected_early_and_admitted_requests_meet_their_slo(admitting):
    slo_ms = _warm_up(admitting, seed=1)
    results = burst(admitting.target, _prompts(BURST, 2), [0] * BURST, slo_ms)
    rejected = [r for r in results if r.rejected]
    admitted_s = _admitted_ttfts_s(results)
    assert rejected and admitted_s, (len(rejected), len(admitted_s), slo_ms)
    assert all("TTFT" in r.reason and r.retry_after_s is not None and r.retry_after_s > 0 for r in rejected)
    assert len(rejected) >= len(results) // 4  # the tail of the burst was turned away, not queued
    assert admitting.server.service.metrics.snapshot()["rejected_requests_total"]["ttft_slo"] >= len(rejected)
    met = sum(ttft_s * 1000.0 <= slo_ms for ttft_s in admitted_s)
    late_allowed = max(1, LATE_PER_TEN_ADMITTED * len(admitted_s) // 10)
    assert met >= len(admitted_s) - late_allowed, (
        f"{met} met: {sorted(round(t * 1000) for t in admitted_s)} ms vs SLO {slo_ms:.0f} ms"
    )
    admitting.check_workers_clean()  # rejections reserved nothing; admitted requests freed theirs


def test_the_same_burst_without_admission_misses_the_slo_for_most(admitting):
    slo_ms = _warm_up(admitting, seed=3)
    gate = admitting.server.service.admission
    predictive, gate.policy = gate.policy, AlwaysAdmitPolicy(gate.config)  # same cluster, same moment
    try:
        results = burst(admitting.target, _prompts(BURST, 4), [0] * BURST, slo_ms)
    finally:
        gate.policy = predictive
    admitted_s = _admitted_ttfts_s(results)
    assert len(admitted_s) == BURST
    missed = sum(ttft_s * 1000.0 > slo_ms for ttft_s in admitted_s)
    assert missed > BURST // 2, (missed, slo_ms)
    admitting.check_workers_clean()


def test_lower_priorities_are_shed_first(admitting):
    # Priority -3 may use 10% of the room for load (shed step 0.3 per level), priority 0 all of it. Only
    # the first ~10 arrivals of a burst find room at all (then the queue and the wait in the router's
    # intake fill the budget), and they come in no fixed order: a gap this wide shows in every such draw.
    slo_ms = _warm_up(admitting, seed=5)
    priorities = [-3 if i % 2 else 0 for i in range(40)]
    results = burst(admitting.target, _prompts(40, 6), priorities, slo_ms)
    shed = {p: sum(r.rejected for r, q in zip(results, priorities) if q == p) for p in (-3, 0)}
    assert shed[-3] > shed[0], shed
    admitting.check_workers_clean()
