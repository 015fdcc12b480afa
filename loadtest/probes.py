"""The calibration's sequential probes: one request at a time through the SDK, each timed to its
first, second and last token, with the host's busy CPU while it was in flight (`loadtest/calibrate.py`
fits the cluster overheads on them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from loadtest.host_clock import busy_cpu_s
from splitserve_client.client import AsyncClient


class Probe(NamedTuple):
    prompt_tokens: int
    ttft_s: float
    gap_s: float  # first to second token
    per_token_s: float  # mean interval after the second token
    busy_cpu_s: float = 0.0  # the host's busy CPU seconds (every process) from the send to the stream's end
    wall_s: float = 0.0  # that window's length
    idle_s: float = 0.0  # how long the cluster had nothing in flight before it was sent


async def measure(
    target: str,
    prompt_lens: list[int],
    vocab: tuple[int, ...],
    token: str | None = None,
    output_tokens: int = 16,
    warmup: int = 4,
    idle_s: float | Sequence[float] = 0.0,
    first: int = 0,
    after_each: Callable[[], Awaitable[None]] | None = None,
) -> list[Probe]:
    """One sequential request per length after `warmup` discarded ones (the lengths in turn), prompts
    sharing no prefix, each sent `idle_s` after the previous one ended (several: request i waits the
    i-th of them, in turn; a served request usually arrives at an idle cluster, not straight after
    another, and waits longer the longer the cluster idled: `fit_overheads`' idle wake-up). Each probe also records the
    host's busy CPU while it was in flight (`busy_cpu_s` over `wall_s`): the idle gaps between probes
    carry only the background, whose error over them would swamp what the probes themselves cost.
    Prompt i is made from index `first + i`: a second calibration of the same cluster passes indices
    past the first's, or its probes hit the prefix cache the first one filled. `after_each` is awaited
    after every request's stream ends (within the idle time that follows: reading the workers)."""
    out = []
    lengths = [prompt_lens[i % len(prompt_lens)] for i in range(warmup)] + list(prompt_lens)
    idles = [idle_s] if isinstance(idle_s, int | float) else list(idle_s)
    async with AsyncClient(target, token=token, max_retries=0) as client:
        idle_started_s = time.perf_counter()
        for i, length in enumerate(lengths):
            await asyncio.sleep(max(idles[i % len(idles)] - (time.perf_counter() - idle_started_s), 0.0))
            idled_s = time.perf_counter() - idle_started_s
            prompt = [vocab[((first + i) * 7919 + j * 104729) % len(vocab)] for j in range(length)]
            busy_before_s = busy_cpu_s()
            started_s, times = time.perf_counter(), []
            async for chunk in client.generate_stream(
                prompt, max_tokens=output_tokens, temperature=0.0, ignore_eos=True
            ):
                times += [time.perf_counter() - started_s] * len(chunk.token_ids)
            wall_s, busy_s = time.perf_counter() - started_s, busy_cpu_s() - busy_before_s
            idle_started_s = time.perf_counter()
            per_token_s = (times[-1] - times[1]) / (len(times) - 2)
            out.append(Probe(length, times[0], times[1] - times[0], per_token_s, busy_s, wall_s, idled_s))
            if after_each is not None:
                await after_each()
    return out[warmup:]
