"""Calibrating a profile's cluster overheads against a running cluster.

The engine profile times steps inside one process; a request through the cluster also pays the
router, Ray calls and streaming, and its hand-off's fixed costs. `calibrate` sends sequential
requests (nothing else should load the cluster) of two-token outputs through the SDK, simulates
each alone on 1P1D with the profile and no overheads, and sets:
- route: the median of (measured TTFT - simulated TTFT): router, Ray calls and the first token's trip;
- adopt: the median of (measured - simulated) gap between the first and second token: reserve,
  announce, the transfer's fixed part, adopt, and the second token's trip beyond the first's.
first_token and token stay 0: only their difference would show in TPOT, and both trips are lumped
into route and adopt above. The figures are printed beside what was measured.
"""
from __future__ import annotations

import statistics
import time

from cluster.sim.config import SimConfig
from cluster.sim.profile import Overheads, Profile
from cluster.sim.seq import SimRequest
from cluster.sim.simulator import simulate
from router.client import AsyncClient


async def measure(target: str, prompt_lens: list[int], vocab: tuple[int, ...], token: str | None = None) -> list[tuple]:
    """(prompt tokens, TTFT s, first-to-second-token gap s) of one sequential request per length."""
    out = []
    async with AsyncClient(target, token=token, max_retries=0) as client:
        for i, length in enumerate(prompt_lens):
            prompt = [vocab[(i * 7919 + j * 104729) % len(vocab)] for j in range(length)]  # no shared prefix
            started_s, times = time.perf_counter(), []
            async for chunk in client.generate_stream(prompt, max_tokens=2, temperature=0.0, ignore_eos=True):
                times += [time.perf_counter() - started_s] * len(chunk.token_ids)
            out.append((length, times[0], times[-1] - times[0]))
    return out


def fit_overheads(profile: Profile, measured: list[tuple]) -> tuple[Overheads, list[dict]]:
    bare = profile.with_overheads(Overheads())
    rows, ttft_extra, gap_extra = [], [], []
    for length, ttft_s, gap_s in measured:
        record = simulate(SimConfig(), bare, [SimRequest(0.0, length, 2)]).records[0]
        sim_gap = record.last_token_s - record.first_token_s
        ttft_extra.append(ttft_s - record.ttft_s)
        gap_extra.append(gap_s - sim_gap)
        rows.append({"prompt_tokens": length, "ttft_ms": ttft_s * 1e3, "sim_ttft_ms": record.ttft_s * 1e3,
                     "gap_ms": gap_s * 1e3, "sim_gap_ms": sim_gap * 1e3})
    overheads = Overheads(route_s=max(statistics.median(ttft_extra), 0.0), adopt_s=max(statistics.median(gap_extra), 0.0))
    return overheads, rows


def format_rows(rows: list[dict], overheads: Overheads) -> str:
    lines = [f"{'prompt':>7} {'TTFT ms':>9} {'sim':>9} {'gap ms':>8} {'sim':>8}"]
    lines += [f"{r['prompt_tokens']:>7} {r['ttft_ms']:>9.1f} {r['sim_ttft_ms']:>9.1f} {r['gap_ms']:>8.1f} "
              f"{r['sim_gap_ms']:>8.1f}" for r in rows]
    lines.append(f"overheads: route {overheads.route_s * 1e3:.1f} ms, adopt {overheads.adopt_s * 1e3:.1f} ms")
    return "\n".join(lines)
