"""The simulator on tiny workloads whose every time follows by hand from the linear test profile
(tests/sim/sim_factories.py): dense(T) = 1 ms + 0.01 ms * T, hand-off = 5 ms + 0.01 ms per token,
no overheads. Each expected figure is worked out in the comment above it."""
from __future__ import annotations

import math

import pytest

from policies.admission import AdmissionConfig
from sim import Fault, SimConfig, SimRequest, simulate
from sim.worker import EngineLimits
from tests.sim.sim_factories import linear_cost, linear_profile

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731


def _times(result):
    return [(r.first_token_s, r.last_token_s) for r in result.records]


def test_one_request_prefill_handoff_decode():
    # prefill 100 tokens: 1 + 1 = 2 ms; hand-off 5 + 1 = 6 ms -> 8 ms; 2 decode steps of 1.01 ms.
    result = simulate(SimConfig(), linear_profile(), [SimRequest(0.0, 100, 3)])
    (record,) = result.records
    assert (record.first_token_s, record.last_token_s) == (approx(0.002), approx(0.01002))
    assert record.ttft_s == approx(0.002) and record.tpot_s == approx(0.00401)
    assert result.handoff_s == approx(0.006)


def test_chunked_prefill_and_attention_pairs():
    # chunks of 64 then 36: dense 1.64 + 1.36 ms; pairs 64*(0+65/2)=2080 and 36*(64+37/2)=2970 at 100 ns.
    profile = linear_profile(prefill_pair_s=1e-7)
    config = SimConfig(limits=EngineLimits(prefill_chunk_tokens=64))
    (record,) = simulate(config, profile, [SimRequest(0.0, 100, 1)]).records
    assert record.first_token_s == approx(0.00164 + 0.000208 + 0.00136 + 0.000297)
    assert record.last_token_s == record.first_token_s  # one token: done at prefill, nothing handed off


def test_a_run_of_identical_chunks_grows_in_closed_form():
    # 300 tokens in chunks of 100: pairs 5050, 15050, 25050 -> 2.505, 3.505, 4.505 ms.
    profile = linear_profile(prefill_pair_s=1e-7)
    config = SimConfig(limits=EngineLimits(prefill_chunk_tokens=100))
    (record,) = simulate(config, profile, [SimRequest(0.0, 300, 1)]).records
    assert record.first_token_s == approx(0.002505 + 0.003505 + 0.004505)


def test_prefix_hit_computes_only_the_tail():
    # Second request: 6 of its 16-token blocks hit (96 tokens), 4 computed: 1.04 ms; the hand-off still
    # moves all 100 tokens (6 ms), then 2 decode steps.
    keys = tuple(range(6))
    requests = [SimRequest(0.0, 100, 3, keys), SimRequest(1.0, 100, 3, keys)]
    result = simulate(SimConfig(), linear_profile(), requests)
    assert [r.cached_tokens for r in result.records] == [0, 96]
    assert _times(result)[1] == (approx(1.00104), approx(1.00906))
    assert result.summary().prefix_hit_rate == approx(96 / 200)
    uncached = simulate(SimConfig(enable_prefix_caching=False), linear_profile(), requests)
    assert [r.cached_tokens for r in uncached.records] == [0, 0]


def test_colocated_decodes_in_the_prefill_batch():
    # One step prefills both (200 tokens: 3 ms), then 2 steps of 2 rows reading 202 context tokens at
    # 1 us each, the second step one token per row more: 3 + (1.02 + 0.202) + (1.02 + 0.204) ms.
    profile = linear_profile(decode_context_s=1e-6)
    result = simulate(SimConfig(prefill=0, decode=0, colocated=1), profile,
                      [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3)])
    assert _times(result) == [(approx(0.003), approx(0.005446))] * 2
    assert result.workers == 1


def test_a_new_sequence_cuts_a_decode_run_at_the_next_step():
    # r0 decodes 10 steps of 1.01 ms from 8 ms. r1: prefill 5-7 ms, hand-off 8-14 ms (the sender was
    # busy until 8). It joins at r0's 6th step boundary (14.06 ms); 2 steps of 2 rows (1.02 ms each)
    # end r1 at 16.1 ms, then r0's last 2 steps alone end at 18.12 ms.
    result = simulate(SimConfig(), linear_profile(), [SimRequest(0.0, 100, 11), SimRequest(0.005, 100, 3)])
    assert _times(result) == [(approx(0.002), approx(0.01812)), (approx(0.007), approx(0.0161))]


def test_a_full_decode_instance_makes_the_handoff_wait():
    # 128 KV tokens = 8 blocks; each request reserves ceil(102/16) = 7. Both prefill in one 3 ms step;
    # r1's hand-off waits for r0 to end (9 + 2.02 = 11.02 ms), moves 11.02-17.02, decodes to 19.04.
    config = SimConfig(decode_kv_tokens=128)
    result = simulate(config, linear_profile(), [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3)])
    assert _times(result) == [(approx(0.003), approx(0.01102)), (approx(0.003), approx(0.01904))]


def test_a_decode_fault_migrates_and_resumes_on_another_instance():
    # r0 decodes from 8 ms, one step per 1.01 ms; at 9.5 ms it has streamed 2 tokens. Its prompt + 2
    # (102 tokens) is prefilled again (2.02 ms: token 3), moved (5 + 1.02 ms), and the remaining 8
    # tokens decode on instance 1: 9.5 + 2.02 + 6.02 + 8.08 = 25.62 ms.
    config = SimConfig(decode=2, faults=(Fault(0.0095, "decode", 0),))
    (record,) = simulate(config, linear_profile(), [SimRequest(0.0, 100, 11)]).records
    assert record.status == "ok" and record.migrations == 1
    assert (record.first_token_s, record.last_token_s) == (approx(0.002), approx(0.02562))


def test_a_request_beyond_the_migration_limit_fails():
    config = SimConfig(decode=2, migration_limit=0, faults=(Fault(0.0095, "decode", 0),))
    (record,) = simulate(config, linear_profile(), [SimRequest(0.0, 100, 11)]).records
    assert record.status == "failed" and not record.met(None, None)


def test_a_lone_pool_waits_for_the_replacement():
    # The only decode instance dies at 9.5 ms; its replacement serves from 9.5 + 100 ms.
    config = SimConfig(faults=(Fault(0.0095, "decode", 0),), restart_s=0.1)
    (record,) = simulate(config, linear_profile(), [SimRequest(0.0, 100, 11)]).records
    assert record.status == "ok" and record.last_token_s == approx(0.1095 + 0.00202 + 0.00602 + 0.00808)


def test_threshold_admission_refuses_on_the_queue_the_route_sees():
    # `threshold` judges the load already on the routed workers, never the request's own size: the
    # prefill worker's uncached tokens queued (booked at routing, released at the first token) against
    # max_queued_prompt_tokens = 250, with one prefill worker. At t = 0: r0 (100 tokens) sees 0 queued,
    # admitted (queue 100); r1 (200) sees 100 < 250, admitted (queue 300); r2 (50) sees 300 >= 250,
    # refused for queued_tokens. r3 (100) at 1 s finds r0 and r1 long done (both prompts are one 300-token
    # step: first tokens at dense(300) = 4 ms), the queue empty: admitted, and alone its TTFT is
    # dense(100) = 2 ms. 3 of 4 requests complete (no SLO set: completed is met).
    requests = [SimRequest(0.0, 100, 3), SimRequest(0.0, 200, 3), SimRequest(0.0, 50, 3), SimRequest(1.0, 100, 3)]
    admission = AdmissionConfig(policy="threshold", max_queued_prompt_tokens=250)
    config = SimConfig(admission="threshold", admission_config=admission)
    result = simulate(config, linear_profile(), requests)
    assert [r.status for r in result.records] == ["ok", "ok", "rejected", "ok"]
    assert [r.refusal for r in result.records] == ["", "", "queued_tokens", ""]
    assert [r.first_token_s for r in result.records[:2]] == [approx(0.004), approx(0.004)]
    assert result.records[3].ttft_s == approx(0.002)
    assert result.summary().slo_attainment == 0.75


def test_threshold_admission_counts_the_decode_streams_the_router_has_routed():
    # max_running_requests = 2: the decode instance's streams are every request routed there and not
    # ended, before its first token too (the router's ledger). At t = 0 r0 sees 0 streams, r1 sees 1,
    # r2 sees 2 >= 2: refused for running_requests. r3 at 1 s sees none (r0 and r1 ended by
    # 4 + 6 + 2 x 1.01 ms, at most 15 ms): admitted.
    requests = [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3), SimRequest(1.0, 100, 3)]
    config = SimConfig(admission="threshold", admission_config=AdmissionConfig("threshold", max_running_requests=2))
    result = simulate(config, linear_profile(), requests)
    assert [r.status for r in result.records] == ["ok", "ok", "rejected", "ok"]
    assert result.records[2].refusal == "running_requests"


def test_router_limit_and_client_concurrency():
    requests = [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3)]
    limited = simulate(SimConfig(router_max_requests=1), linear_profile(), requests)
    assert [r.status for r in limited.records] == ["ok", "rejected"]
    assert [r.refusal for r in limited.records] == ["", "concurrency"]
    # Two routers, each with that limit: both requests are served, each as if alone on its prefill worker.
    shared = simulate(SimConfig(prefill=2, router_max_requests=1, routers=2), linear_profile(), requests)
    assert [r.status for r in shared.records] == ["ok", "ok"]
    assert shared.records[0].ttft_s == approx(shared.records[1].ttft_s)
    # One open stream: r1 is sent when r0 ends (10.02 ms) and then runs as r0 did.
    capped = simulate(SimConfig(max_concurrency=1), linear_profile(), requests)
    assert capped.records[1].send_s == approx(0.01002)
    assert capped.records[1].ttft_s == approx(0.002) and capped.records[1].last_token_s == approx(0.02004)


def test_tensor_parallel_decode_uses_its_own_step_cost():
    # The tp-2 step is half the tp-1 one: 2 decode steps of 0.505 ms.
    half = linear_cost()
    half = type(half)(half.knots_tokens, tuple(v / 2 for v in half.dense_s))
    profile = linear_profile(tp_cost={2: half})
    result = simulate(SimConfig(tp=2), profile, [SimRequest(0.0, 100, 3)])
    assert result.records[0].last_token_s == approx(0.008 + 0.00101)
    assert result.workers == 3 and result.config_name == "1P1D tp2"


@pytest.mark.parametrize("policy, cached", [("cache_aware", 96), ("least_loaded", 96), ("round_robin", 0)])
def test_routing_policies_on_two_prefill_workers(policy, cached):
    # r0 finds both idle: cache_aware sends it to the first of the two in its prompt's ring order,
    # least_loaded and round_robin to prefill-0 (the smaller id). Both are idle again when r1 comes:
    # cache_aware follows r0 (cost 4 tokens against 100), least_loaded keeps prefill-0 (its cache hits),
    # round_robin sends it to prefill-1, whose cache is empty.
    keys = tuple(range(6))
    config = SimConfig(prefill=2, policy=policy)
    result = simulate(config, linear_profile(), [SimRequest(0.0, 100, 3, keys), SimRequest(1.0, 100, 3, keys)])
    assert result.records[1].cached_tokens == cached


def test_summary_figures():
    # TTFTs 2 ms and 1.04 ms; with a 1.5 ms SLO one request meets it; duration 0 .. 1.00906 s.
    keys = tuple(range(6))
    result = simulate(SimConfig(ttft_slo_s=0.0015), linear_profile(),
                      [SimRequest(0.0, 100, 3, keys), SimRequest(1.0, 100, 3, keys)])
    summary = result.summary()
    assert summary.slo_attainment == 0.5
    assert summary.goodput_per_s == approx(1 / 1.00906)
    assert summary.ttft_ms["p50"] == approx((2.0 + 1.04) / 2)
    assert summary.tpot_ms["mean"] == approx(((10.02 - 2.0) / 2 + (1009.06 - 1001.04) / 2) / 2)


def test_runs_are_deterministic_and_leak_no_block():
    import random

    rng = random.Random(7)
    requests = sorted((SimRequest(rng.uniform(0, 2), rng.randint(20, 400), rng.randint(1, 40),
                                  tuple(range(rng.randint(0, 5)))) for _ in range(300)), key=lambda r: r.arrival_s)
    config = SimConfig(prefill=2, decode=2, decode_kv_tokens=2048, prefill_kv_tokens=1024,
                       faults=(Fault(0.7, "prefill", 1), Fault(1.1, "decode", 0)), restart_s=0.2)
    from sim.simulator import Simulation

    sim = Simulation(config, linear_profile(decode_context_s=1e-7))
    first = sim.run(requests)
    assert _times(first) == _times(simulate(config, linear_profile(decode_context_s=1e-7), requests))
    assert all(r.status == "ok" for r in first.records)
    for worker in sim.front:
        worker.kv.check_integrity()
        assert worker.kv.num_free_blocks == worker.kv.num_blocks
    assert all(w.kv.used == 0 for w in sim.decode)


def test_a_request_finding_the_cluster_idle_waits_its_wake_up():
    # idle_wake 2 ms x ln(1 + idle / 0.1 s). A at 0 (nothing ran before: idle 0, no wake-up): first
    # token at 2 ms, last at 10.02 ms. B at 0.5 s: idle since 10.02 ms, 0.48998 s, so it waits
    # 2 ms x ln(1 + 4.8998) more before its 2 ms prefill. C at 0.501 s while B is in flight: no wake-up.
    from sim.profile import Overheads

    profile = linear_profile(overheads=Overheads(idle_wake_s=0.002))
    requests = [SimRequest(0.0, 100, 3), SimRequest(0.5, 100, 3), SimRequest(0.501, 100, 1)]
    a, b, c = simulate(SimConfig(prefill=2), profile, requests).records
    wake_s = 0.002 * math.log1p((0.5 - 0.01002) / 0.1)
    assert (a.first_token_s, a.last_token_s) == (approx(0.002), approx(0.01002))
    assert b.first_token_s == approx(0.5 + wake_s + 0.002)
    assert c.first_token_s == approx(0.501 + 0.002)  # on the other prefill worker, no wake-up


def test_the_decode_step_scale_slows_only_the_decode_instances():
    # x1.5 on decode steps: prefill 2 ms as before, hand-off 6 ms, 2 decode steps of 1.515 ms.
    from sim.profile import Overheads

    profile = linear_profile(overheads=Overheads(decode_step_scale=1.5))
    (record,) = simulate(SimConfig(), profile, [SimRequest(0.0, 100, 3)]).records
    assert (record.first_token_s, record.last_token_s) == (approx(0.002), approx(0.008 + 2 * 0.001515))
