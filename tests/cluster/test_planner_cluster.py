"""The online planner on a real cluster: real Ray workers, a real router reporting its traffic to the
controller, the controller's planner loop scaling through `scale`.

The profile is synthetic and slow on purpose (4 ms per token computed, 1 ms per 1000 KV tokens a
decode row reads), so the right answer does not depend on the host's speed: from 4.5 to 8
requests/s one prefill worker and one decode instance miss the SLO in the simulator and 2P2D meets
it; below 3 requests/s 1P1D does (the test checks these facts on the pure planner first). The load
steps up (6/s), then down (0.3/s). The planner must grow by the first round that sees the load
(a round whose window caught only part of the step may grow one pool first: still growth), reach
2P2D, only grow while the load is up, only shrink once it is down, back to 1P1D within a few rounds,
never below one worker per pool; and every request sent (through the scale-down's drain too)
completes with HF's greedy tokens.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import ray

from common.config import ControllerConfig
from cluster.planner import Observation, Planner, PlannerConfig, Pools
from sim.profile import ModelFacts, Profile, Transfer
from sim.step_cost import StepCost
from splitserve_client.client import AsyncClient
from tests.factories import TinySpec, hf_greedy_generate, random_prompts
from tests.router.cleanliness import wait_workers_clean
from tests.router.conftest import router_config, start_router

HIGH_RATE, LOW_RATE = 6.0, 0.3  # requests per second
PROMPT_TOKENS, MAX_TOKENS = (30, 50), 6
HIGH_MIN_RATE = 4.5  # an observation at least this high is "the load is up"


def slow_profile() -> Profile:
    cost = StepCost((1, 1001), (0.005, 4.005), 0.0, 0.0, 1e-3)  # 1 ms + 4 ms per token; 1 ms per 1000 KV reads
    return Profile("measured", "synthetic slow profile (test)", "test", ModelFacts("tiny", 1000, 1000, 4096, 512),
                   {1: cost}, {1: 100_000}, Transfer(0.001, 1e9))


def planner_config(profile_path) -> PlannerConfig:
    return PlannerConfig(enabled=True, profile_path=str(profile_path), interval_s=2.0, cooldown_s=2.0,
                         report_interval_s=0.5, ttft_ms=1000.0, tpot_ms=700.0, max_workers=4, window_requests=100,
                         scale_down_intervals=2)


def test_the_profile_makes_the_right_answer_clear(tmp_path):
    planner = Planner(planner_config(slow_profile().save(tmp_path / "p.json")), slow_profile())
    for rate in (HIGH_MIN_RATE, HIGH_RATE, 8.0):  # 8/s: a window holding one report too many at 6/s
        assert not planner.meets(Observation(rate, 40, MAX_TOKENS), Pools(1, 1))
        assert planner.desired(Observation(rate, 40, MAX_TOKENS)) == Pools(2, 2)
    for rate in (0.5, 0.5 * 1.2):  # the low phase sees 0 or 1 arrival per 2 s window; the shrink's headroom
        assert planner.desired(Observation(rate, 40, MAX_TOKENS), ceiling=Pools(2, 2)) == Pools(1, 1)
    assert planner.meets(Observation(2.0, 40, MAX_TOKENS), Pools(1, 1))


async def _open_loop(target: str, prompts, rate_per_s: float, until, outcomes: list) -> None:
    """Requests at `rate_per_s` (evenly spaced) until `until()` holds; each outcome appended."""
    async with AsyncClient(target, timeout_s=60.0) as client:
        async def one(i: int) -> None:
            try:
                done = await client.generate(prompts[i % len(prompts)], temperature=0.0, max_tokens=MAX_TOKENS,
                                             ignore_eos=True)
                outcomes.append((i % len(prompts), list(done.token_ids)))
            except Exception as err:  # collected: the test asserts there are none
                outcomes.append((i % len(prompts), err))

        tasks, i = [], len(outcomes)
        while not until():
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
            await asyncio.sleep(1.0 / rate_per_s)
        await asyncio.wait_for(asyncio.gather(*tasks), 60.0)


def _status(stack) -> dict:
    return ray.get(stack.cluster.controller.planner_status(), timeout=10)


def _serving(stack, role: str) -> int:
    return len(getattr(stack.server.service.cluster.membership, role))


def test_planner_scales_up_and_down_with_the_load_and_fails_no_request(ray_session, checkpoint, tmp_path):
    model_dir = checkpoint(TinySpec())
    config = router_config()
    config = replace(config, planner=planner_config(slow_profile().save(tmp_path / "slow.json")),
                     controller=ControllerConfig(drain_quiet_s=0.5))
    prompts = random_prompts(6, *PROMPT_TOKENS, 512, seed=21)
    expected = hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    stack = start_router(model_dir, config)
    outcomes: list = []
    try:
        started_s = time.monotonic()
        grown = lambda: (_serving(stack, "prefill"), _serving(stack, "decode")) == (2, 2)  # noqa: E731
        asyncio.run(_open_loop(stack.target, prompts, HIGH_RATE, lambda: grown() or time.monotonic() - started_s > 25,
                               outcomes))
        assert grown(), f"the planner did not grow to 2P2D: {_status(stack)['rounds']}"
        high_rounds = len(_status(stack)["rounds"])
        low_from_s = time.monotonic()
        shrunk = lambda: len(stack.server.service.cluster.membership.members) == 2  # noqa: E731
        asyncio.run(_open_loop(stack.target, prompts, LOW_RATE, lambda: shrunk() or time.monotonic() - low_from_s > 25,
                               outcomes))
        status = _status(stack)
        assert shrunk(), f"the planner did not shrink back to 1P1D: {status['rounds']}"
        stack.cluster.refresh()
        wait_workers_clean(stack.cluster)
    finally:
        stack.stop()
    errors = [r for _, r in outcomes if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert len(outcomes) >= 10 and all(r == expected[i] for i, r in outcomes)
    _check_rounds(status["rounds"], high_rounds)


def _check_rounds(rounds: list[dict], high_rounds: int) -> None:
    """`high_rounds`: how many rounds had run when the load stepped down."""
    decisions = [(i, r) for i, r in enumerate(rounds) if r["decision"] is not None]
    assert all(r["decision"]["prefill"] >= 1 and r["decision"]["decode"] >= 1 for _, r in decisions)
    first_high = next(i for i, r in enumerate(rounds) if r["observation"]["arrival_rate_per_s"] >= HIGH_MIN_RATE)
    assert decisions and decisions[0][0] <= first_high, "the first round that saw the load up must grow the pools"
    for i, r in decisions:
        before, after = r["current"], r["decision"]
        if i < high_rounds:
            assert after["prefill"] >= before["prefill"] and after["decode"] >= before["decode"], (i, r)
        else:
            assert after["prefill"] <= before["prefill"] and after["decode"] <= before["decode"], (i, r)
    shrink_at, shrink = decisions[-1]
    assert shrink_at >= high_rounds and shrink["decision"] == {"prefill": 1, "decode": 1}
    # once the load was down: a round whose window still held some of it, the cooldown's round, then
    # `scale_down_intervals` (2) votes, and one round of slack for a busy box
    assert shrink_at - high_rounds <= 5
