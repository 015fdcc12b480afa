"""Prompts sent while other requests stream: what a prefill worker loses to the work beside it.

The simulator's host sharing (sim/contention.py) has two figures only overlapping requests
show, both fitted here on a running cluster, on every shape (the loss grows with the workers sharing
the cores):
- `host_prefill_interference`: a prefill engine feels the decode streams' demand this much more than
  a decode engine does (its long steps are preempted again and again). Fitted on prompts B sent once
  one or two requests A stream (each A past its second token: its hand-off is over);
- `host_handoff_cores`: the cores a hand-off keeps busy from its transfer's start to its adoption
  (the sender's and the receiver's threads copying and importing the KV). Fitted on prompts B sent at
  A's first token, when A's hand-off starts beside B's prefill, with the prefill interference just
  fitted. Before this part the host model had no place for the hand-off: such overlaps pushed the
  prefill interference to its bound (x8).

Each fit is a bisection on the median over the overlaps of simulated less measured TTFT (each
overlap simulated alone, from the same sends): a median, so that one overlap caught by a collection
pause or a daemon waking cannot move it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from loadtest.calibrate import solve_increasing
from loadtest.host_cpu import MAX_INTERFERENCE
from sim.config import SimConfig
from sim.profile import Profile
from sim.seq import SimRequest
from sim.simulator import simulate
from splitserve_client.client import AsyncClient

# Each A streams OVERLAP_STREAM (prompt, output tokens); B asks for OVERLAP_OUTPUT_TOKENS.
OVERLAP_STREAM, OVERLAP_OUTPUT_TOKENS = (64, 48), 2
# (B's prompt tokens, A streams, B sent at the A's token 1 or 2) per overlap: one and two streams, so
# that on two decode instances (the router spreads the A's over them) B's prefill also meets two
# decode engines; at token 2 for the prefill interference, at token 1 for the hand-off.
OVERLAP_PLAN = tuple(
    (tokens, streams, at_token)
    for at_token in (2, 1)
    for streams in (1, 2)
    for tokens in (128, 256, 384, 512)
    for _ in range(3)
)
OVERLAP_FIRST_INDEX, OVERLAP_IDLE_S, OVERLAP_TIMEOUT_S = 200_000, 0.3, 30.0
MAX_HANDOFF_CORES = 4.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Overlap(NamedTuple):
    """B's prompt, its send after the `streams` A's were sent at once (each had token `at_token` by
    then), and B's TTFT."""

    prompt_tokens: int
    sent_after_s: float
    ttft_s: float
    streams: int = 1
    at_token: int = 2

    def requests(self) -> list[SimRequest]:
        b = SimRequest(self.sent_after_s, self.prompt_tokens, OVERLAP_OUTPUT_TOKENS)
        return [SimRequest(0.0, *OVERLAP_STREAM)] * self.streams + [b]


async def measure_overlaps(
    target: str,
    vocab: tuple[int, ...],
    first: int = OVERLAP_FIRST_INDEX,
    plan: Sequence[tuple[int, int, int]] = OVERLAP_PLAN,
) -> list[Overlap]:
    """Per (prompt tokens, streams, at token) of `plan`: `streams` A's sent at once, B sent the moment
    every A has that token, B's TTFT; each after OVERLAP_IDLE_S idle, its prompts from indices `first`
    on (none shared)."""
    out = []
    spacing = 1 + max((streams for _, streams, _ in plan), default=1)
    async with AsyncClient(target, max_retries=0) as client:

        def prompt(index: int, tokens: int) -> list[int]:
            return [vocab[(index * 7919 + j * 104729 + 57) % len(vocab)] for j in range(tokens)]

        async def a_stream(index: int, at_token: int, reached: asyncio.Future) -> None:
            a = client.generate_stream(prompt(index, OVERLAP_STREAM[0]), max_tokens=OVERLAP_STREAM[1], **GREEDY)
            tokens = 0
            try:
                async for _ in a:
                    tokens += 1
                    if tokens == at_token:
                        reached.set_result(None)
            finally:
                if not reached.done():
                    reached.set_exception(RuntimeError(f"overlap: stream A ended after {tokens} token(s)"))

        for i, (tokens, streams, at_token) in enumerate(plan):
            await asyncio.sleep(OVERLAP_IDLE_S)
            base = first + i * spacing
            reached = [asyncio.get_running_loop().create_future() for _ in range(streams)]
            sent_s = time.perf_counter()
            a_tasks = [asyncio.ensure_future(a_stream(base + k, at_token, f)) for k, f in enumerate(reached)]
            try:
                await asyncio.wait_for(asyncio.gather(*reached), OVERLAP_TIMEOUT_S)
            except BaseException:
                for task in a_tasks:
                    task.cancel()
                raise
            b_sent_s, ttft_s = time.perf_counter(), None
            b = client.generate_stream(prompt(base + streams, tokens), max_tokens=OVERLAP_OUTPUT_TOKENS, **GREEDY)
            async for _ in b:
                ttft_s = time.perf_counter() - b_sent_s if ttft_s is None else ttft_s
            await asyncio.wait_for(asyncio.gather(*a_tasks), OVERLAP_TIMEOUT_S)
            if ttft_s is not None:
                out.append(Overlap(tokens, b_sent_s - sent_s, ttft_s, streams, at_token))
    return out


def _fit(
    profile: Profile, overlaps: Sequence[Overlap], host_with: Callable[[float], SimConfig], low: float, high: float
) -> float:
    """The value in [low, high] at which the overlaps, each simulated alone on `host_with(value)`, give
    B its first token as late as measured: the median of simulated less measured TTFT is zero. Each
    simulated TTFT grows with either figure, and so does their median: bisection."""

    def median_error_s(value: float) -> float:
        config, errors = host_with(value), []
        for o in overlaps:
            ttft_s = simulate(config, profile, o.requests()).records[o.streams].ttft_s
            errors.append(math.inf if ttft_s is None else ttft_s - o.ttft_s)
        return statistics.median(errors)

    return round(solve_increasing(median_error_s, 0.0, low, high, 0.01), 3)


def fit_prefill_interference(profile: Profile, host: SimConfig, overlaps: Sequence[Overlap]) -> float:
    """The `host_prefill_interference` (1 to MAX_INTERFERENCE) the overlaps measured (`_fit`)."""

    def host_with(value: float) -> SimConfig:
        return dataclasses.replace(host, host_prefill_interference=value)

    return _fit(profile, overlaps, host_with, 1.0, MAX_INTERFERENCE)


def fit_handoff_cores(profile: Profile, host: SimConfig, overlaps: Sequence[Overlap]) -> float:
    """The `host_handoff_cores` (0 to MAX_HANDOFF_CORES) the overlaps measured (`_fit`)."""

    def host_with(value: float) -> SimConfig:
        return dataclasses.replace(host, host_handoff_cores=value)

    return _fit(profile, overlaps, host_with, 0.0, MAX_HANDOFF_CORES)


def fit_overlaps(profile: Profile, host: SimConfig, overlaps: Sequence[Overlap]) -> SimConfig:
    """`host` with its prefill interference fitted on the overlaps past the A's hand-offs, then its
    hand-off cores on those at the A's first token (either left as it is when no overlap is of its kind)."""
    streaming = [o for o in overlaps if o.at_token >= 2]
    if streaming:
        host = dataclasses.replace(host, host_prefill_interference=fit_prefill_interference(profile, host, streaming))
    handing_off = [o for o in overlaps if o.at_token == 1]
    if handing_off:
        host = dataclasses.replace(host, host_handoff_cores=fit_handoff_cores(profile, host, handing_off))
    return host
