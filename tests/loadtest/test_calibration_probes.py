"""The calibration's sequential probes against a real router: each records the host's busy CPU while
it was in flight, and `first` picks prompts an earlier calibration has not put in the prefix cache."""

from __future__ import annotations

import asyncio
import os

import pytest

from sim.seq import SimRequest
from loadtest.cluster_calibration import PROBE_OUTPUT_TOKENS, in_flight_sample
from loadtest.probes import Probe, measure
from splitserve_client.client import AsyncClient

VOCAB = tuple(range(10, 250))  # ids of the tiny checkpoint (the probes ignore EOS)
TICK_S = 0.01  # /proc/stat's resolution, per core


def _cached_total(target: str) -> int:
    async def status():
        async with AsyncClient(target, max_retries=0) as client:
            return (await client.status()).cached_prompt_tokens_total

    return asyncio.run(status())


def _probes(target: str, first: int, lengths=(64, 96)) -> list[Probe]:
    return asyncio.run(measure(target, list(lengths), VOCAB, output_tokens=4, warmup=0, first=first))


def test_probes_record_the_host_cpu_while_in_flight_and_new_indices_miss_the_cache(router_target):
    before = _cached_total(router_target)
    first = _probes(router_target, first=7000)
    after_first = _cached_total(router_target)
    later = _probes(router_target, first=7002)
    after_later = _cached_total(router_target)
    again = _probes(router_target, first=7000, lengths=(64,))
    after_again = _cached_total(router_target)

    for probe in first + later + again:
        assert probe.wall_s >= probe.ttft_s > 0, probe
        assert 0 <= probe.busy_cpu_s <= probe.wall_s * os.cpu_count() + 2 * TICK_S * os.cpu_count(), probe
    assert sum(p.busy_cpu_s for p in first + later) > 0  # the engines computed during them
    assert after_first == before and after_later == after_first  # fresh indices: nothing cached to hit
    assert after_again - after_later >= 48  # index 7000 again: its 64-token prompt's full blocks hit


def test_the_in_flight_sample_sums_the_probes_windows_and_simulates_their_prompts():
    probes = [Probe(64, 0.02, 0.01, 0.005, 0.031, 0.09), Probe(256, 0.05, 0.01, 0.005, 0.052, 0.13)]
    sample = in_flight_sample(probes)
    assert sample.busy_s == 0.031 + 0.052 and sample.window_s == 0.09 + 0.13
    assert sample.rounds == [[SimRequest(0.0, 64, PROBE_OUTPUT_TOKENS)], [SimRequest(0.0, 256, PROBE_OUTPUT_TOKENS)]]


def test_engine_time_between_two_readings_takes_the_median_batch_1_decode_step():
    from typing import NamedTuple

    from engine.step_log import StepRecord
    from loadtest.cluster_calibration import EngineTime

    class Reading(NamedTuple):
        seconds: float
        steps: int
        recent: tuple = ()

    # Decode steps of 5 ms at batch 1, one 20 ms step adopting a sequence, one batch-2 step of 9 ms.
    recent = tuple(StepRecord(i, 0.005, 1, 1, 100) for i in range(5)) + (
        StepRecord(5, 0.020, 1, 1, 100),
        StepRecord(6, 0.009, 2, 2, 200),
    )
    before = {"prefill": Reading(1.0, 10), "decode": Reading(2.0, 100)}
    after = {"prefill": Reading(1.2, 12), "decode": Reading(2.054, 107)}
    engines = EngineTime.between(before, after, recent)
    assert engines.seconds == pytest.approx(0.254) and (engines.steps, engines.decode_steps) == (9, 7)
    assert engines.decode_step_s == 0.005  # the median: neither the adopting step nor the batch of two
    with pytest.raises(ValueError, match="batch-1"):
        EngineTime.between(before, {**after, "decode": Reading(2.0, 100)}, recent)
    with pytest.raises(ValueError, match="batch-1"):
        EngineTime.between(before, after, recent[-1:])
    # Prefill steps: one fresh prompt each, (tokens, seconds); a chunk after cached tokens (context
    # beyond its own tokens) or a batch of two prompts is left out.
    prefill = (
        StepRecord(1, 0.030, 256, 1, 256),
        StepRecord(2, 0.012, 64, 1, 192),
        StepRecord(3, 0.040, 384, 2, 384),
        StepRecord(4, 0.045, 384, 1, 384),
    )
    assert EngineTime.between(before, after, recent, prefill).prefill_steps == ((256, 0.030), (384, 0.045))


def test_an_overlap_sends_b_once_every_a_streams_and_times_b_from_its_own_send(router_target):
    from loadtest.overlaps import OVERLAP_STREAM, measure_overlaps

    overlaps = asyncio.run(measure_overlaps(router_target, VOCAB, first=9100, plan=((96, 1, 2), (160, 2, 1))))
    assert [(o.prompt_tokens, o.streams, o.at_token) for o in overlaps] == [(96, 1, 2), (160, 2, 1)]
    for o in overlaps:
        assert o.sent_after_s > 0 and o.ttft_s > 0, o  # B went out at the A's tokens, not with them
        *streams, b = o.requests()
        assert [(a.arrival_s, a.prompt_tokens, a.output_tokens) for a in streams] == [
            (0.0, *OVERLAP_STREAM)
        ] * o.streams
        assert (b.arrival_s, b.prompt_tokens) == (o.sent_after_s, o.prompt_tokens)
