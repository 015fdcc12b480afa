"""Admission control on a real small cluster with a tight TTFT SLO: a burst is answered with early
RESOURCE_EXHAUSTED rejections (reason + retry-after) instead of queueing past the SLO, most admitted
requests meet it, lower priorities are shed first, and no block is left reserved."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from router.admission import AdmissionConfig
from router.client import AsyncClient
from router.sdk_types import ResourceExhausted
from tests.factories import TinySpec, random_prompts
from tests.router.conftest import router_config, start_router

TTFT_SLO_MS = 400.0


@pytest.fixture(scope="module")
def admitting(ray_session, checkpoint):
    config = router_config()
    admission = AdmissionConfig(policy="predictive", default_ttft_ms=TTFT_SLO_MS, default_tpot_ms=10_000.0,
                                cost_min_samples=4, shed_step_per_priority=0.3)
    config = replace(config, admission=admission, decode=replace(config.decode, num_kv_blocks=4096))
    stack = start_router(checkpoint(TinySpec()), config)
    yield stack
    stack.stop()


async def _burst(target: str, prompts, priorities) -> list:
    async with AsyncClient(target, max_retries=0) as client:
        async def one(prompt, priority):
            try:
                return await client.generate(prompt, temperature=0.0, max_tokens=2, ignore_eos=True,
                                             priority=priority, timeout_s=60)
            except ResourceExhausted as err:
                return err
        return await asyncio.gather(*(one(p, q) for p, q in zip(prompts, priorities)))


def _warm_up(stack) -> None:
    """Enough prefill steps for the cost model to leave its prior, then one probe so the router has them."""
    asyncio.run(_burst(stack.target, random_prompts(12, 100, 400, 512, seed=1), [0] * 12))
    stack.loop.call(stack.server.service.monitor.probe_all())


def test_a_burst_is_rejected_early_instead_of_queueing_past_the_slo(admitting):
    _warm_up(admitting)
    prompts = random_prompts(80, 400, 480, 512, seed=2)
    results = asyncio.run(_burst(admitting.target, prompts, [0] * len(prompts)))
    rejected = [r for r in results if isinstance(r, ResourceExhausted)]
    admitted = [r for r in results if not isinstance(r, ResourceExhausted)]
    assert rejected and admitted, (len(rejected), len(admitted))
    assert all("TTFT" in r.reason and r.retry_after_s is not None and r.retry_after_s > 0 for r in rejected)
    snapshot = admitting.server.service.metrics.snapshot()
    assert snapshot["rejected_requests_total"]["ttft_slo"] == len(rejected)
    admitting.check_workers_clean()  # rejections reserved nothing; admitted requests freed theirs


def test_lower_priorities_are_shed_first(admitting):
    _warm_up(admitting)
    prompts = random_prompts(40, 400, 480, 512, seed=3)
    priorities = [-2 if i % 2 else 0 for i in range(len(prompts))]
    results = asyncio.run(_burst(admitting.target, prompts, priorities))
    shed = {p: sum(isinstance(r, ResourceExhausted) for r, q in zip(results, priorities) if q == p) for p in (-2, 0)}
    assert shed[-2] > shed[0], shed
    first_shed = {q for r, q in zip(results, priorities) if isinstance(r, ResourceExhausted)}
    assert -2 in first_shed
    admitting.check_workers_clean()
