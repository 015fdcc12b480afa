"""The host CPU figures the validation feeds the simulator's host sharing (loadtest/host_cpu.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from sim import SimConfig, SimRequest, simulate
from sim.profile import Overheads
from loadtest.host_clock import busy_cpu_s
from loadtest.host_cpu import (
    MAX_INTERFERENCE,
    CpuSample,
    engines_of,
    fit_stream_cpu,
    fit_stream_interference,
    idle_cores,
    with_host_cpu,
)
from tests.sim.sim_factories import linear_profile


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_host_busy_counter_counts_this_process_burning_a_core():
    before = busy_cpu_s()
    _spin(0.3)
    assert busy_cpu_s() - before >= 0.2  # /proc/stat ticks at 10 ms; other processes only add


def test_around_work_it_reports_the_busy_cpu_and_the_wall_time():
    async def burn() -> str:
        _spin(0.3)
        return "done"

    result, busy_s, window_s = asyncio.run(with_host_cpu(burn()))
    assert result == "done" and window_s >= 0.3 and busy_s >= 0.2
    # A thread burning a core through the whole window shows up as (at least most of) a busy core.
    spinner = threading.Thread(target=_spin, args=(0.5,))
    spinner.start()
    try:
        assert asyncio.run(idle_cores(0.3)) >= 0.6
    finally:
        spinner.join()


def test_streaming_cpu_is_what_is_left_after_background_and_engines_split_by_steps_and_tokens():
    # linear profile, 1P1D. A request of 100 prompt tokens and 3 output tokens alone: prefill 2 ms,
    # then 2 decode steps of 1.01 ms: 4.02 ms of engines, 2 decode steps, 3 tokens.
    profile = linear_profile()
    alone = simulate(SimConfig(), profile, [SimRequest(0.0, 100, 3)])
    assert (sum(alone.busy_s.values()), alone.steps["decode"]) == (pytest.approx(0.00402), 2)
    # Two such requests one after the other, then a burst of four of 30 output tokens at once (their
    # 6 ms hand-offs come in turn, so their decode rows overlap in batches of up to 4): its engines'
    # time and decode steps as the simulator has them. Host busy figures made from a known 1 ms per decode
    # step and 2 ms per token over 0.1 background cores: the fit recovers both.
    sequential = [[SimRequest(0.0, 100, 3)]] * 2
    together = [[SimRequest(0.0, 100, 30)] * 4]
    burst = simulate(SimConfig(), profile, together[0])
    assert burst.steps["decode"] < 4 * 29  # batched: fewer steps than tokens
    per_step_s, per_token_s, background = 0.001, 0.002, 0.1

    def busy(engines_s: float, steps: int, tokens: int, window_s: float) -> float:
        return engines_s + per_step_s * steps + per_token_s * tokens + background * window_s

    samples = [
        CpuSample(sequential, busy(0.00804, 4, 6, 1.0), 1.0),
        CpuSample(together, busy(sum(burst.busy_s.values()), burst.steps["decode"], 120, 0.5), 0.5),
    ]
    assert fit_stream_cpu(profile, samples, background) == (pytest.approx(per_step_s), pytest.approx(per_token_s))
    # One sample cannot separate them: all of it is charged per token (here 4 ms + 6 x 2 ms over 6 tokens).
    assert fit_stream_cpu(profile, samples[:1], background) == (0.0, pytest.approx((0.004 + 0.012) / 6))
    # Less busy than background and engines together: nothing left for streaming, never negative.
    assert fit_stream_cpu(profile, [CpuSample(sequential, 0.05, 1.0)], background) == (0.0, 0.0)
    with pytest.raises(ValueError, match="at least one output token"):
        fit_stream_cpu(profile, [], background)


def test_interference_is_the_factor_at_which_simulated_bursts_end_when_measured_ones_did():
    # tests/sim/test_sim_contention.py's 1P1D timeline on one core: a request (100 prompt tokens, 3
    # output) ends at 8 ms + 2.02 ms x s, with s = (1 + sqrt(1 + 4 f)) / 2 at interference f (1.01 ms
    # of streaming per 1.01 ms decode step). Measured ends made at f = 2 (s = 2) and f = 3.5 (s = 2.5).
    profile = linear_profile()
    host = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.00101)
    rounds = [[SimRequest(0.0, 100, 3)]] * 2
    assert fit_stream_interference(profile, host, rounds, [0.008 + 0.00202 * 2] * 2) == pytest.approx(2.0, abs=0.01)
    ends = [0.008 + 0.00202 * 2, 0.008 + 0.00202 * 2.5]  # the mean lies between: 2 < f < 3.5
    assert 2.0 < fit_stream_interference(profile, host, rounds, ends) < 3.5
    # Ends the model reaches without interference: 1, never below; ends beyond any factor: the cap.
    assert fit_stream_interference(profile, host, rounds, [0.009] * 2) == 1.0
    assert fit_stream_interference(profile, host, rounds, [1.0] * 2) == MAX_INTERFERENCE


def test_streaming_cpu_is_fitted_on_the_pools_the_samples_ran_on():
    # The same burst on 1P2D: the two decode instances split its batch, so they run more decode steps
    # for the same tokens than one instance does. Busy figures made on 1P2D with known costs: the fit
    # on 1P2D recovers them; taking the samples for 1P1D's would put the extra steps' cost elsewhere.
    profile = linear_profile()
    two_decode = SimConfig(decode=2)
    sequential = [[SimRequest(0.0, 100, 3)]] * 2
    together = [[SimRequest(0.0, 100, 30)] * 4]
    split, joined = simulate(two_decode, profile, together[0]), simulate(SimConfig(), profile, together[0])
    assert split.steps["decode"] > joined.steps["decode"]
    per_step_s, per_token_s, background = 0.001, 0.002, 0.1
    samples = [
        CpuSample(sequential, 0.00804 + per_step_s * 4 + per_token_s * 6 + background, 1.0),
        CpuSample(
            together,
            sum(split.busy_s.values()) + per_step_s * split.steps["decode"] + per_token_s * 120 + background * 0.5,
            0.5,
        ),
    ]
    assert fit_stream_cpu(profile, samples, background, two_decode) == (
        pytest.approx(per_step_s),
        pytest.approx(per_token_s),
    )
    assert fit_stream_cpu(profile, samples, background) != pytest.approx((per_step_s, per_token_s))
    # The host figures of the pools given are ignored: what the engines alone demand is fitted against.
    hosted = SimConfig(
        decode=2,
        host_cores=1,
        host_stream_cpu_per_token_s=0.01,
        host_stream_interference=3.0,
        host_prefill_interference=2.0,
    )
    assert fit_stream_cpu(profile, samples, background, hosted) == (
        pytest.approx(per_step_s),
        pytest.approx(per_token_s),
    )
    assert engines_of(hosted) == two_decode


def test_a_sample_with_measured_engine_time_uses_it_and_its_measured_decode_steps():
    # The sequential probes' engines were timed by the workers: 9 ms over 7 steps of which 5 decode
    # (numbers a simulation of the profile would not give). With a 0.5 ms step overhead the workers
    # count as their own, the rest after 0.1 cores of background is streaming: 1 ms per decode step
    # and 2 ms per token, recovered beside a burst that is simulated as before.
    profile = linear_profile().with_overheads(Overheads(step_s=0.0005))
    per_step_s, per_token_s, background = 0.001, 0.002, 0.1
    engines_s, engine_steps, decode_steps, tokens = 0.009, 7, 5, 6
    measured_busy = engines_s + 0.0005 * engine_steps + per_step_s * decode_steps + per_token_s * tokens + background
    sequential = CpuSample([[SimRequest(0.0, 100, 3)]] * 2, measured_busy, 1.0, engines_s, engine_steps, decode_steps)
    together = [[SimRequest(0.0, 100, 30)] * 4]
    burst = simulate(SimConfig(), profile, together[0])
    burst_busy = sum(burst.busy_s.values()) + per_step_s * burst.steps["decode"] + per_token_s * 120 + background * 0.5
    samples = [sequential, CpuSample(together, burst_busy, 0.5)]
    assert fit_stream_cpu(profile, samples, background) == (pytest.approx(per_step_s), pytest.approx(per_token_s))
    # Simulating the sequential probes instead (4.02 ms of engines each, 2 decode steps) misreads them.
    simulated = samples[0]._replace(engine_s=None)
    assert fit_stream_cpu(profile, [simulated, samples[1]], background) != pytest.approx((per_step_s, per_token_s))
