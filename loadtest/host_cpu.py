"""What a cluster sharing this host's cores burns besides its engine steps, measured around a calibration.

The simulator's host sharing (sim/contention.py) needs, beside the profile:
- background cores: what the host keeps busy while the cluster idles (Ray's daemons, the controller
  and rendezvous loops, anything else running): `idle_cores` over a quiet window;
- streaming CPU per decode step and per output token: what the workers' outbox and poll threads, the
  router relaying tokens and the client reading them cost the host. While calibration requests are
  in flight (each sequential probe, loadtest/calibrate.py; the bursts, `with_host_cpu`), the host's
  busy CPU less the background over those windows and less the engines' own busy time (the calibrated
  profile simulating the same requests) is what streaming cost; `fit_stream_cpu` splits it between
  steps and tokens over runs of different batch sizes (sequential requests: one token per step; a
  burst sent at once: several). Prompt-side costs
  (routing, the hand-off) are folded in: every calibration request has a prompt, so they are not
  separated;
- streaming's interference: its wake-ups preempt the engine threads, which then slow down by more
  than the CPU the streaming threads burn. `fit_stream_interference` finds the factor on streaming's
  demand at which the simulated bursts end, on average, when the measured ones did.

/proc/stat counts every process on the host, so this means something only when the cluster and its
clients run here (benchmarks/validate_sim.py); on a shared box the other jobs land in the background
figure, which is also what the cluster's steps then compete with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from loadtest.calibrate import solve_increasing
from loadtest.host_clock import busy_cpu_s
from sim.config import SimConfig
from sim.profile import Profile
from sim.seq import SimRequest
from sim.simulator import simulate
from splitserve_client.client import AsyncClient

T = TypeVar("T")


async def idle_cores(window_s: float = 2.0) -> float:
    """Busy cores, on average, over `window_s` in which this process sends nothing."""
    before_s, started_s = busy_cpu_s(), time.perf_counter()
    await asyncio.sleep(window_s)
    return (busy_cpu_s() - before_s) / (time.perf_counter() - started_s)


async def burst(
    target: str, vocab: tuple[int, ...], prompt_lens: Sequence[int], output_tokens: int, first: int = 0
) -> list[float]:
    """One request per entry of `prompt_lens`, all sent at once and each streamed to its end; returns
    each one's seconds from the send to its stream's end. Prompt i is made from index `first + i`:
    distinct indices give prompts sharing no prefix, so a later burst with other indices finds nothing
    of an earlier one in the prefix cache."""
    async with AsyncClient(target, max_retries=0) as client:
        sent_s = time.perf_counter()

        async def one(i: int, prompt_tokens: int) -> float:
            prompt = [vocab[(i * 7919 + j * 104729 + 31) % len(vocab)] for j in range(prompt_tokens)]
            stream = client.generate_stream(prompt, max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
            async for _ in stream:
                pass
            return time.perf_counter() - sent_s

        return list(await asyncio.gather(*(one(first + i, n) for i, n in enumerate(prompt_lens))))


async def with_host_cpu(work: Awaitable[T]) -> tuple[T, float, float]:
    """(result, host busy CPU seconds, wall seconds) of awaiting `work`."""
    before_s, started_s = busy_cpu_s(), time.perf_counter()
    result = await work
    return result, busy_cpu_s() - before_s, time.perf_counter() - started_s


class CpuSample(NamedTuple):
    """Requests the cluster served while the host was busy `busy_s` over `window_s`: each of `rounds`
    sent at once, the rounds one after another. `engine_s`, when the workers' step timings were read
    around it: the engines' measured step seconds in it (all pools; `engine_steps` steps, of which
    `decode_steps` the decode pool's), used instead of simulating them."""

    rounds: list[list[SimRequest]]
    busy_s: float
    window_s: float
    engine_s: float | None = None
    engine_steps: int = 0
    decode_steps: int = 0


def fit_stream_cpu(
    profile: Profile, samples: Sequence[CpuSample], background_cores: float, cluster: SimConfig | None = None
) -> tuple[float, float]:
    """(per decode step, per output token) host CPU seconds outside the engines: a non-negative least-
    squares fit of what each sample left after the background and the engines' simulated busy time
    (each round simulated alone on `cluster`'s pools, default 1P1D, the shape the samples ran on: two decode
    instances split a burst's batch and so run more steps for it) against its simulated decode steps
    and output tokens. Samples of different batch sizes separate the two; one sample gives its cost
    per token. A sample with measured engine time (`engine_s`) uses it and its measured decode steps,
    plus the profile's step overhead per step (which the simulator counts as the workers' own, busy
    time): sequential probes, one engine stepping at a time, so its step seconds are its CPU seconds."""
    engines_only = engines_of(cluster or SimConfig())
    rows, left = [], []
    for sample in samples:
        tokens = sum(r.output_tokens for requests in sample.rounds for r in requests)
        if sample.engine_s is not None:
            engines_s, steps = sample.engine_s + profile.overheads.step_s * sample.engine_steps, sample.decode_steps
        else:
            results = [simulate(engines_only, profile, requests) for requests in sample.rounds]
            engines_s = sum(sum(r.busy_s.values()) for r in results) * profile.threads_per_worker
            steps = sum(r.steps["decode"] for r in results)
        rows.append((steps, tokens))
        left.append(max(sample.busy_s - background_cores * sample.window_s - engines_s, 0.0))
    if not rows or not all(tokens for _, tokens in rows):
        raise ValueError("the streaming cost needs samples of at least one output token each")
    a = np.asarray(rows, dtype=float)
    (per_step_s, per_token_s), *_ = np.linalg.lstsq(a, np.asarray(left), rcond=None)
    if len(samples) < 2 or per_step_s < 0 or per_token_s < 0:  # one cost alone: the better of the two
        per_token = (0.0, sum(left) / a[:, 1].sum())
        per_step = (sum(left) / max(a[:, 0].sum(), 1.0), 0.0)
        residual = [np.square(a @ np.asarray(p) - left).sum() for p in (per_token, per_step)]
        per_step_s, per_token_s = per_token if len(samples) < 2 or residual[0] <= residual[1] else per_step
    return float(per_step_s), float(per_token_s)


def engines_of(cluster: SimConfig) -> SimConfig:
    """`cluster`'s pools and limits without its host figures: what the engines alone demand."""
    return dataclasses.replace(
        cluster,
        host_cores=None,
        host_background_cores=0.0,
        host_stream_cpu_per_step_s=0.0,
        host_stream_cpu_per_token_s=0.0,
        host_stream_interference=1.0,
        host_prefill_interference=1.0,
        host_handoff_cores=0.0,
    )


def fit_stream_interference(
    profile: Profile, host: SimConfig, rounds: Sequence[Sequence[SimRequest]], measured_e2e_s: Sequence[float]
) -> float:
    """The `host_stream_interference` (1 to MAX_INTERFERENCE) at which `rounds`, each simulated alone on
    `host` (its host figures set), end their requests on average when the measured ones did
    (`measured_e2e_s`: every round's requests, in order). The mean grows with the factor: bisection."""

    def mean_e2e_s(interference: float) -> float:
        config = dataclasses.replace(host, host_stream_interference=interference)
        ends = [r.end_s - r.send_s for requests in rounds for r in simulate(config, profile, list(requests)).records]
        return sum(ends) / len(ends)

    target_s = sum(measured_e2e_s) / len(measured_e2e_s)
    return round(solve_increasing(mean_e2e_s, target_s, 1.0, MAX_INTERFERENCE, 0.01), 3)


class StreamCosts(NamedTuple):
    per_step_s: float
    per_token_s: float
    interference: float


MAX_INTERFERENCE = 8.0
# Prompts of several lengths sent at once: the longer ones prefill while the shorter ones decode and
# stream, the overlap the interference is about.
BURST_PROMPT_TOKENS, BURST_OUTPUT_TOKENS, BURST_ROUNDS = (64, 128, 256, 384) * 2, 32, 3
BURST_FIRST_INDEX = 100_000  # past the indices of the warm-up bursts before it (benchmarks/validate_sim.py)


class BurstSample(NamedTuple):
    """The calibration's bursts: the host CPU around them, and every request's end (seconds from its send)."""

    cpu: CpuSample
    ends_s: list[float]


async def measure_bursts(target: str, vocab: tuple[int, ...], first: int = BURST_FIRST_INDEX) -> BurstSample:
    """`BURST_ROUNDS` bursts of requests sent at once (decode batches of up to 8), one after another,
    their prompts from indices `first` on (`burst`)."""
    ends_s: list[float] = []

    async def bursts() -> None:
        for r in range(BURST_ROUNDS):  # each round its own prompts: the simulation charges every prefill
            start = first + r * len(BURST_PROMPT_TOKENS)
            ends_s.extend(await burst(target, vocab, BURST_PROMPT_TOKENS, BURST_OUTPUT_TOKENS, start))

    _, busy_s, window_s = await with_host_cpu(bursts())
    one = [SimRequest(0.0, n, BURST_OUTPUT_TOKENS) for n in BURST_PROMPT_TOKENS]
    return BurstSample(CpuSample([one] * BURST_ROUNDS, busy_s, window_s), ends_s)


def fit_stream_costs(profile: Profile, sequential: CpuSample, bursts: BurstSample, host: SimConfig) -> StreamCosts:
    """`fit_stream_cpu` over the sequential calibration's sample and the bursts, then
    `fit_stream_interference` on the bursts, `host` (the pools they ran on, its cores and background
    set) with the streaming costs just fitted."""
    per_step_s, per_token_s = fit_stream_cpu(profile, [sequential, bursts.cpu], host.host_background_cores, host)
    host = dataclasses.replace(host, host_stream_cpu_per_step_s=per_step_s, host_stream_cpu_per_token_s=per_token_s)
    return StreamCosts(
        per_step_s, per_token_s, fit_stream_interference(profile, host, bursts.cpu.rounds, bursts.ends_s)
    )
