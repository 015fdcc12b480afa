"""Workers sharing a host's cores (sim/contention.py), on the linear test profile
(tests/sim/sim_factories.py: dense(T) = 1 ms + 0.01 ms * T, no other cost). Each expected figure
is worked out in the comment above it."""

from __future__ import annotations

import dataclasses

import pytest

from sim import Profile, SimConfig, SimRequest, simulate
from sim.contention import HostShare
from tests.sim.sim_factories import linear_profile

TWO_COLOCATED = {"prefill": 0, "decode": 0, "colocated": 2, "policy": "round_robin"}
approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731


def test_stretch_is_demand_over_cores_never_below_one():
    two = HostShare(cores=2)
    assert [two.stretch(busy) for busy in range(5)] == [1.0, 1.0, 1.0, 1.5, 2.0]
    assert HostShare(cores=2, background=1.0).stretch(2) == 1.5  # 2 workers + 1 core of router/client
    assert HostShare(cores=4, threads_per_worker=2).stretch(3) == 1.5  # 6 threads on 4 cores


def test_streaming_cpu_adds_demand_that_slows_down_with_the_steps_it_follows():
    # Two engines on two cores plus 1 core of streaming at profiled speed (250 tokens/s x 4 ms):
    # s * 2 = 2 + 1 / s, so s = (2 + sqrt(4 + 8)) / 4 = 1.3660; the same demand within the cores: 1.
    share = HostShare(cores=2, stream_cpu_per_token_s=0.004)
    assert share.stretch(2, tokens_per_s=250.0) == approx((2 + 12**0.5) / 4)
    assert share.stretch(1, tokens_per_s=250.0) == 1.0  # 1 engine + 1 core of streaming = 2 cores
    assert share.stretch(2) == 1.0  # no tokens streamed: the engines alone
    # Per step and per token: 100 steps/s x 2 ms + 800 tokens/s x 1 ms = the same 1 core.
    mixed = HostShare(cores=2, stream_cpu_per_step_s=0.002, stream_cpu_per_token_s=0.001)
    assert mixed.stretch(2, steps_per_s=100.0, tokens_per_s=800.0) == approx((2 + 12**0.5) / 4)


def test_interference_multiplies_the_streaming_demand_the_engines_feel():
    # The 1 core of streaming above felt as 2: s * 2 = 2 + 2 / s, s = (2 + sqrt(4 + 16)) / 4 = 1.6180;
    # 1 engine + 0.5 core of streaming felt as 1 fits 2 cores: 1. Nothing streamed: nothing to multiply.
    felt_twice = HostShare(cores=2, stream_cpu_per_token_s=0.004, stream_interference=2.0)
    assert felt_twice.stretch(2, tokens_per_s=250.0) == approx((2 + 20**0.5) / 4)
    assert felt_twice.stretch(1, tokens_per_s=125.0) == 1.0
    assert felt_twice.stretch(3) == 1.5
    # Through the simulator: the golden-ratio timeline below with K felt as 2 cores: s = (1 + 3) / 2 = 2.
    config = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.00101, host_stream_interference=2.0)
    (record,) = simulate(config, linear_profile(), [SimRequest(0.0, 100, 3)]).records
    assert record.last_token_s == approx(0.008 + 0.00202 * 2)


def test_two_busy_workers_on_one_core_take_twice_as_long():
    # Two colocated workers each prefill 100 tokens from t=0: 2 ms alone; on one shared core both are
    # busy throughout, so each step takes 2 x 2 = 4 ms.
    requests = [SimRequest(0.0, 100, 1), SimRequest(0.0, 100, 1)]
    alone = simulate(SimConfig(**TWO_COLOCATED), linear_profile(), requests)
    shared = simulate(SimConfig(**TWO_COLOCATED, host_cores=1), linear_profile(), requests)
    assert [r.first_token_s for r in alone.records] == [approx(0.002), approx(0.002)]
    assert [r.first_token_s for r in shared.records] == [approx(0.004), approx(0.004)]


def test_runs_in_progress_are_retimed_at_their_next_step_boundary():
    # One core. A (worker 0): prefill 100 tokens alone 0-2 ms, then 10 decode steps of 1.01 ms.
    # B (worker 1) arrives at 3 ms: both busy, stretch 2. A's step under way ends at 3.01 ms, then its
    # steps take 2.02 ms (5.03, 7.05, ...); B's prefill takes 4 ms: first token at 7 ms, and B stops.
    # Alone again, A's step under way (from 5.03) ends at 7.05 ms; its last 7 steps take 1.01 ms each:
    # 7.05 + 7.07 = 14.12 ms. All 10 decode steps: 1 + 2 + 7.
    requests = [SimRequest(0.0, 100, 11), SimRequest(0.003, 100, 1)]
    result = simulate(SimConfig(**TWO_COLOCATED, host_cores=1), linear_profile(), requests)
    a, b = result.records
    assert (a.first_token_s, a.last_token_s) == (approx(0.002), approx(0.01412))
    assert b.first_token_s == approx(0.007)


def test_threads_and_background_count_toward_the_demand():
    # 1P1D, prefill 100 tokens then a 6 ms hand-off, 2 decode steps of 1.01 ms: only one worker is
    # ever busy. Two threads each plus one core of background on two cores: stretch (2 + 1) / 2 = 1.5,
    # so prefill 3 ms, hand-off 6 ms (not a step), decode 2 x 1.515 ms: last token at 12.03 ms.
    profile = dataclasses.replace(linear_profile(), threads_per_worker=2)
    config = SimConfig(host_cores=2, host_background_cores=1.0)
    (record,) = simulate(config, profile, [SimRequest(0.0, 100, 3)]).records
    assert (record.first_token_s, record.last_token_s) == (approx(0.003), approx(0.01203))
    # A host with cores to spare changes nothing: the figures of a worker per accelerator.
    (spare,) = simulate(SimConfig(host_cores=8), profile, [SimRequest(0.0, 100, 3)]).records
    assert (spare.first_token_s, spare.last_token_s) == (approx(0.002), approx(0.01002))


def test_a_decode_run_streaming_tokens_is_stretched_by_its_own_streaming():
    # The 1P1D timeline above on one core: prefill 100 tokens alone, 2 ms (nothing streams yet); a
    # 6 ms hand-off; then batch-1 decode steps of 1.01 ms, each token costing the host 1.01 ms more:
    # E = 1, K = 1.01 ms x (1 / 1.01 ms) = 1 core, s = (1 + sqrt(5)) / 2. Last token at
    # 8 ms + 2 x 1.01 ms x s.
    config = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.00101)
    (record,) = simulate(config, linear_profile(), [SimRequest(0.0, 100, 3)]).records
    golden = (1 + 5**0.5) / 2
    assert (record.first_token_s, record.last_token_s) == (approx(0.002), approx(0.008 + 0.00202 * golden))


def test_host_settings_are_validated_and_threads_round_trip(tmp_path):
    with pytest.raises(ValueError, match=r"^host_cores:"):
        SimConfig(host_cores=0)
    with pytest.raises(ValueError, match=r"^host_background_cores: needs host_cores"):
        SimConfig(host_background_cores=1.0)
    with pytest.raises(ValueError, match=r"^host_stream_cpu_per_token_s: needs host_cores"):
        SimConfig(host_stream_cpu_per_token_s=0.001)
    with pytest.raises(ValueError, match=r"^host_stream_cpu_per_token_s: must be a number >= 0"):
        SimConfig(host_cores=2, host_stream_cpu_per_token_s=-1.0)
    with pytest.raises(ValueError, match=r"^host_stream_cpu_per_step_s: needs host_cores"):
        SimConfig(host_stream_cpu_per_step_s=0.001)
    with pytest.raises(ValueError, match=r"^host_stream_interference: must be a number >= 1"):
        SimConfig(host_cores=2, host_stream_interference=0.5)
    with pytest.raises(ValueError, match=r"^host_stream_interference: needs host_cores"):
        SimConfig(host_stream_interference=2.0)
    with pytest.raises(ValueError, match="interference >= 1"):
        HostShare(cores=2, stream_interference=0.9)
    profile = dataclasses.replace(linear_profile(), threads_per_worker=3)
    assert Profile.load(profile.save(tmp_path / "p.json")).threads_per_worker == 3
    with pytest.raises(ValueError, match=r"^threads_per_worker:"):
        dataclasses.replace(profile, threads_per_worker=0)


def test_prefill_workers_feel_streaming_prefill_interference_times_more():
    # The 1 core of streaming of the test above felt x2 by prefill workers only: theirs stretch as
    # there, 1.6180; the decode workers' as with no interference, 1.3660.
    share = HostShare(cores=2, stream_cpu_per_token_s=0.004, prefill_interference=2.0)
    assert share.stretch(2, tokens_per_s=250.0, prefill=True) == approx((2 + 20**0.5) / 4)
    assert share.stretch(2, tokens_per_s=250.0) == approx((2 + 12**0.5) / 4)
    # Through the simulator, one core: a decode run streaming alone is stretched by its own streaming
    # (the golden ratio of the test below), whatever the prefill interference; a prefill worker feels it.
    config = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.00101, host_prefill_interference=3.0)
    (record,) = simulate(config, linear_profile(), [SimRequest(0.0, 100, 3)]).records
    assert record.last_token_s == approx(0.008 + 0.00202 * (1 + 5**0.5) / 2)
    # B's 100-token prefill (2 ms alone) from 8 ms, as A starts decoding at batch 1: E = 2 busy, K = 1
    # core, felt x3 by B: s = (2 + sqrt(4 + 12)) / 2 = 3, so 6 ms; without the factor (2 + sqrt(8)) / 2.
    # A's decode steps stretch (2 + sqrt(8)) / 2 either way while B runs, for longer with the factor.
    overlapping = [SimRequest(0.0, 100, 40), SimRequest(0.008, 100, 1)]
    a, b = simulate(dataclasses.replace(config, prefill=2), linear_profile(), overlapping).records
    plain_a, plain_b = simulate(
        dataclasses.replace(config, prefill=2, host_prefill_interference=1.0), linear_profile(), overlapping
    ).records
    assert (b.ttft_s, plain_b.ttft_s) == (approx(0.006), approx(0.002 * (2 + 8**0.5) / 2))
    assert a.last_token_s > plain_a.last_token_s
    with pytest.raises(ValueError, match=r"^host_prefill_interference: must be a number >= 1"):
        SimConfig(host_cores=2, host_prefill_interference=0.5)


def test_a_handoff_in_progress_keeps_its_cores_busy_until_its_adoption():
    # A (100 tokens) is prefilled by 2 ms and handed off from 2 to 8 ms (the linear profile's
    # transfer), decoding from 8 ms. B's 100-token prefill (2 ms alone) starts at 3 ms on the other
    # prefill worker: on one core beside a hand-off of 1 core, E = 1 + 1 = 2, so 4 ms, all before 8 ms.
    config = SimConfig(prefill=2, host_cores=1, host_handoff_cores=1.0)
    overlapping = [SimRequest(0.0, 100, 2), SimRequest(0.003, 100, 1)]
    a, b = simulate(config, linear_profile(), overlapping).records
    assert a.last_token_s == approx(0.008 + 0.00101)  # A's one decode step, after its adoption: not stretched
    assert b.ttft_s == approx(0.004)
    plain = simulate(dataclasses.replace(config, host_handoff_cores=0.0), linear_profile(), overlapping).records
    assert plain[1].ttft_s == approx(0.002)
    with pytest.raises(ValueError, match=r"^host_handoff_cores: needs host_cores"):
        SimConfig(host_handoff_cores=0.5)
