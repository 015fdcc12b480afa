"""Bringing a freshly launched cluster to its steady speed before anything on it is timed
(benchmarks/validate_sim.py, benchmarks/bench_handoff_overlap.py)."""

from __future__ import annotations

from loadtest.host_cpu import burst
from loadtest.probes import measure

# Sequential requests after the warm-up rounds, before the calibration: a fresh cluster's engine steps
# kept getting faster over its first ~150 requests (the workers' step records over successive rounds
# of 36 probes: prefill x1.53 -> 1.44 -> 1.35 -> 1.32 of the profile, decode batch-1 steps
# -7% from the first round to the second), so a calibration straight after two rounds measured a
# colder cluster than the bench that followed it (decode steps simulated 5-10% slow on 1P1D).
STEADY_REQUESTS, STEADY_FIRST_INDEX = 160, 900_000


async def warm_up(target: str, vocab: tuple[int, ...], concurrent: int, rounds: int, steady: int = 0) -> None:
    """`rounds` of `concurrent` requests at once, then `steady` sequential ones of 32-512 prompt tokens
    (results discarded, prompts shared with nothing timed): every worker and every prefill->decode pair
    serves some, and the engines reach their steady speed, before anything is timed."""
    n = max(concurrent, 2)
    for r in range(rounds):
        await burst(target, vocab, [64 + 64 * (i % 4) for i in range(n)], 8, first=r * n)
    if steady:
        lengths = [32 + (i * 37) % 481 for i in range(steady)]
        await measure(target, lengths, vocab, output_tokens=16, warmup=0, idle_s=0.0, first=STEADY_FIRST_INDEX)
