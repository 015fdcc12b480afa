"""Admission control on a real small cluster with a tight TTFT SLO: a burst is answered with early
RESOURCE_EXHAUSTED rejections (reason + retry-after) instead of all of it queueing, lower priorities
are shed first, and no block is left reserved.

Not asserted (yet): that admitted requests meet their SLO. Under a burst on this 2-core machine the
predictions still run short (observed 30-100% of admitted within the SLO, run to run); the gate's
TTFT calibration narrows the gap as requests finish. The README's known gaps say so."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from router.admission import AdmissionConfig
from router.client import AsyncClient
from router.sdk_types import ResourceExhausted
from tests.factories import TinySpec, random_prompts
from tests.router.conftest import router_config, start_router


@pytest.fixture(scope="module")
def admitting(ray_session, checkpoint):
    config = router_config()
    admission = AdmissionConfig(policy="predictive", default_tpot_ms=10_000.0, cost_min_samples=4,
                                shed_step_per_priority=0.3)
    config = replace(config, admission=admission, decode=replace(config.decode, num_kv_blocks=4096))
    stack = start_router(checkpoint(TinySpec()), config)
    yield stack
    stack.stop()


async def _burst(target: str, prompts, priorities, ttft_ms: float) -> list:
    """All at once; per request the ResourceExhausted error, or the TTFT its client saw (s)."""
    async with AsyncClient(target, max_retries=0) as client:
        async def one(prompt, priority):
            started_s, ttft_s = time.perf_counter(), None
            try:
                async for _ in client.generate_stream(prompt, temperature=0.0, max_tokens=2, ignore_eos=True,
                                                      priority=priority, ttft_ms=ttft_ms, timeout_s=60):
                    ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started_s
                return ttft_s
            except ResourceExhausted as err:
                return err
        return await asyncio.gather(*(one(p, q) for p, q in zip(prompts, priorities)))


def _warm_up(stack) -> float:
    """Prefill steps for the cost model to fit, one probe so the router has them; returns a TTFT SLO
    (ms) with room for about 20 of the burst's prompts, so the test holds on fast and slow machines."""
    asyncio.run(_burst(stack.target, random_prompts(12, 100, 400, 512, seed=1), [0] * 12, 60_000.0))
    stack.loop.call(stack.server.service.monitor.probe_all())
    per_prompt_s = stack.server.service.admission.prefill_cost.fit().time_s(440)
    return max(20 * per_prompt_s * 1000.0, 50.0)


def test_a_burst_is_rejected_early_instead_of_queueing_past_the_slo(admitting):
    slo_ms = _warm_up(admitting)
    results = asyncio.run(_burst(admitting.target, random_prompts(80, 400, 480, 512, seed=2), [0] * 80, slo_ms))
    rejected = [r for r in results if isinstance(r, ResourceExhausted)]
    admitted_ttft_s = [r for r in results if not isinstance(r, ResourceExhausted)]
    assert rejected and admitted_ttft_s, (len(rejected), len(admitted_ttft_s), slo_ms)
    assert all("TTFT" in r.reason and r.retry_after_s is not None and r.retry_after_s > 0 for r in rejected)
    assert len(rejected) >= len(results) // 4  # the tail of the burst was turned away, not queued
    assert admitting.server.service.metrics.snapshot()["rejected_requests_total"]["ttft_slo"] >= len(rejected)
    admitting.check_workers_clean()  # rejections reserved nothing; admitted requests freed theirs


def test_lower_priorities_are_shed_first(admitting):
    slo_ms = _warm_up(admitting)
    priorities = [-2 if i % 2 else 0 for i in range(40)]
    results = asyncio.run(_burst(admitting.target, random_prompts(40, 400, 480, 512, seed=3), priorities, slo_ms))
    shed = {p: sum(isinstance(r, ResourceExhausted) for r, q in zip(results, priorities) if q == p) for p in (-2, 0)}
    assert shed[-2] > shed[0], shed
    admitting.check_workers_clean()
