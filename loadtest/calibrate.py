"""Calibrating a profile's cluster overheads against a running cluster.

The engine profile times steps inside one process; a request through the cluster also pays the
router, Ray calls and streaming, and its hand-off's fixed costs. `measure` (loadtest/probes.py) first sends `warmup`
requests whose figures are discarded (a fresh cluster's first requests open channels, build the
hand-off's process groups and warm kernels: tens of ms that later requests never pay again), then
sequential requests (nothing else should load the cluster) of `output_tokens` tokens through the
SDK; `fit_overheads` simulates each alone on 1P1D with the profile and sets, in this order:
- step: the median of (measured - simulated) time per token after the second: what a worker's loop
  adds to each engine step (the actor loop, streaming each step's tokens back). When the decode
  engines' own step timings over the probes are at hand (`decode_step_s`, read from the workers'
  metrics), decode_step_scale is their mean step over the profile's and step what the median probe's
  time per token adds to that mean: measured, not fitted;
- prefill_step_scale: the engine in a prefill worker shares its process (and GIL) with the worker's
  own threads and runs slower than the profiler's engine alone (1.1-1.5x on a 2-core VM). With the
  prefill engines' own step timings (`prefill_steps`) it is the slope of their times against the
  profile's and prefill_step the line's fixed part (`_measured_prefill`); else, with two or more
  prompt lengths, how much faster measured TTFT grows with the prompt than simulated TTFT does (the
  slope of a least-squares line through per-length medians);
- route: (measured TTFT - simulated TTFT): router, Ray calls and the first token's trip;
- adopt: (measured - simulated) gap between the first and second token (with `step` applied):
  reserve, announce, the transfer's fixed part, adopt, the second token's trip.
Route and adopt are fixed costs charged to every request, each the mean of its per-prompt-length
medians; for route that is the intercept of the prefill scale's least-squares line. What each probe
left beyond them becomes the jitter the simulator draws per request (`Overheads.route_jitter_s`,
`adopt_jitter_s`): the stalls the host dealt the probes, for the simulated tails. A difference that
grows with the prompt is the prefill scale's, not an overhead's; what is left stays visible in the
printed rows.
With `host` (a SimConfig with host figures: benchmarks/validate_sim.py, when the simulation shares the
machine's cores) the probes are simulated on that host, so the overheads are what its stretch leaves
unexplained; otherwise a stretch the host model applies again would be counted twice.
first_token and token stay 0: only their difference would show in TPOT, and both trips are lumped
into route and adopt above. The figures are printed beside what was measured.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from loadtest.probes import Probe
from sim.config import SimConfig
from sim.profile import IDLE_WAKE_TAU_S, Overheads, Profile
from sim.seq import SimRequest
from sim.simulator import simulate
from sim.step_cost import prefill_pairs


def _alone(profile: Profile, probe: Probe, output_tokens: int, host: SimConfig) -> Probe:
    record = simulate(host, profile, [SimRequest(0.0, probe.prompt_tokens, output_tokens)]).records[0]
    second = simulate(host, profile, [SimRequest(0.0, probe.prompt_tokens, 2)]).records[0]
    ttft_s, last_s = record.ttft_s, record.last_token_s
    second_first_s, second_last_s = second.first_token_s, second.last_token_s
    if ttft_s is None or last_s is None or second_first_s is None or second_last_s is None:
        raise ValueError(f"the simulator did not finish a {probe.prompt_tokens}-token probe alone")
    per_token = (last_s - second_last_s) / (output_tokens - 2)
    return Probe(probe.prompt_tokens, ttft_s, second_last_s - second_first_s, per_token)


def fit_overheads(
    profile: Profile,
    measured: list[Probe],
    output_tokens: int = 16,
    host: SimConfig | None = None,
    decode_step_s: float | None = None,
    prefill_steps: Sequence[tuple[int, float]] = (),
) -> tuple[Overheads, list[dict]]:
    """`host`: a SimConfig whose host figures (cores, background, streaming) the probes are simulated
    with, so that the overheads are what the host model leaves unexplained (None: no host model).
    `decode_step_s`: the decode engines' own mean step time over the probes (their step timings), which
    pins the decode step scale and the step overhead (`_measured_decode`) instead of fitting them.
    `prefill_steps`: (prompt tokens, seconds) of the prefill engines' own steps that each prefilled
    one whole fresh prompt during the probes; they pin the prefill step scale (`_measured_prefill`)."""
    if output_tokens < 3:
        raise ValueError("calibration needs at least 3 output tokens per request")
    bare = profile.with_overheads(Overheads())
    host = host or SimConfig()
    if decode_step_s is None:
        step_s, decode_scale = _fit_step(bare, measured, output_tokens, host), 1.0
    else:
        step_s, decode_scale = _measured_decode(bare, measured, output_tokens, decode_step_s, host)
    stepped = bare.with_overheads(Overheads(step_s=step_s, decode_step_scale=decode_scale))
    if prefill_steps:
        prefill_fixed_s, scale = _measured_prefill(bare, prefill_steps, step_s)
    else:
        prefill_fixed_s, scale = 0.0, _prefill_scale(stepped, measured, output_tokens, host)
    engines = Overheads(
        step_s=step_s, prefill_step_scale=scale, decode_step_scale=decode_scale, prefill_step_s=prefill_fixed_s
    )
    stepped = bare.with_overheads(engines)
    rows, ttft_extra, gap_extra = [], [], []
    for m in measured:
        sim = _alone(stepped, m, output_tokens, host)
        ttft_extra.append(m.ttft_s - sim.ttft_s)
        gap_extra.append(m.gap_s - sim.gap_s)
        rows.append(
            {
                "prompt_tokens": m.prompt_tokens,
                "ttft_ms": m.ttft_s * 1e3,
                "sim_ttft_ms": sim.ttft_s * 1e3,
                "gap_ms": m.gap_s * 1e3,
                "sim_gap_ms": sim.gap_s * 1e3,
                "per_token_ms": m.per_token_s * 1e3,
                "sim_per_token_ms": sim.per_token_s * 1e3,
            }
        )
    lengths = [m.prompt_tokens for m in measured]
    route_s, wake_s = _route_and_wake(lengths, [m.idle_s for m in measured], ttft_extra)
    overheads = dataclasses.replace(
        engines, route_s=route_s, idle_wake_s=wake_s, adopt_s=_fixed_part(lengths, gap_extra)
    )
    # What each probe left beyond the fixed parts: the simulator draws from these (Overheads.jitter_s).
    route_jitter = [e - route_s - overheads.wake_s(m.idle_s) for e, m in zip(ttft_extra, measured, strict=True)]
    adopt_jitter = [e - overheads.adopt_s for e in gap_extra]
    return dataclasses.replace(overheads, route_jitter_s=tuple(route_jitter), adopt_jitter_s=tuple(adopt_jitter)), rows


PREFILL_SCALE_RANGE = (0.5, 4.0)  # beyond it the probes measured noise, not the engine


def _fit_step(bare: Profile, measured: list[Probe], output_tokens: int, host: SimConfig) -> float:
    """The step overhead at which the median probe's simulated time per token is the measured one.
    Without a host model that is the median difference; with one, a step's cost also moves the
    host's stretch, so it is found by bisection (the simulated time grows with the overhead)."""

    def short_by_s(step_s: float) -> float:
        profile = bare.with_overheads(Overheads(step_s=step_s))
        sim = {
            n: _alone(profile, Probe(n, 0.0, 0.0, 0.0), output_tokens, host)
            for n in {m.prompt_tokens for m in measured}
        }
        return statistics.median(m.per_token_s - sim[m.prompt_tokens].per_token_s for m in measured)

    if host.host_cores is None:
        return max(short_by_s(0.0), 0.0)
    return solve_increasing(lambda step_s: -short_by_s(step_s), 0.0, 0.0, max(m.per_token_s for m in measured), 1e-6)


def _measured_decode(
    bare: Profile, measured: list[Probe], output_tokens: int, decode_step_s: float, host: SimConfig
) -> tuple[float, float]:
    """(step overhead, decode step scale) from the decode engines' measured mean step over the probes.
    A probe's time per token is the engine's step plus the worker's loop around it, both as the host
    stretched them: the scale makes the simulated engine step the measured one and the overhead the
    median time per token the measured one, given the stretch `host` puts on a batch-1 step, which
    itself moves a little with them (a slower step streams less): a fixed point, a few rounds. Fitting
    the overhead to the time per token under the host model instead had two answers: a host stretch
    at batch 1 explained the same time as an overhead did, and calibrations of one cluster landed on
    either (step 0 and 2-3 ms streaming CPU per step, or 1.3-1.6 ms and ~1 ms)."""
    if decode_step_s <= 0:
        raise ValueError(f"the measured decode step must be > 0 s, got {decode_step_s}")
    per_token_s = statistics.median(m.per_token_s for m in measured)
    # A batch-1 engine step cannot outlast the time between the tokens it makes: a step median above
    # the probes' is the step records' noise (fewer, and read from a window), the probes' is what counts.
    decode_step_s = min(decode_step_s, per_token_s)
    lengths = sorted({m.prompt_tokens for m in measured})

    def mean_step_s(config: SimConfig, overheads: Overheads) -> float:
        profile = bare.with_overheads(overheads)
        results = [simulate(config, profile, [SimRequest(0.0, n, output_tokens)]) for n in lengths]
        return sum(r.busy_s["decode"] for r in results) / sum(r.steps["decode"] for r in results)

    profiled_s = mean_step_s(SimConfig(), Overheads())
    low, high = DECODE_SCALE_RANGE
    stretch, gap_s, scale = 1.0, 0.0, 1.0
    for _ in range(MEASURED_DECODE_ROUNDS):
        scale = min(max(decode_step_s / (stretch * profiled_s), low), high)
        gap_s = max(per_token_s - decode_step_s, 0.0) / stretch
        if host.host_cores is None:
            break
        overheads = Overheads(step_s=gap_s, decode_step_scale=scale)
        before, stretch = stretch, mean_step_s(host, overheads) / mean_step_s(SimConfig(), overheads)
        if abs(stretch - before) <= 1e-6 * before:
            break
    return gap_s, scale


MEASURED_DECODE_ROUNDS = 50
DECODE_SCALE_RANGE = (0.25, 8.0)


def solve_increasing(fn: Callable[[float], float], target: float, low: float, high: float, tolerance: float) -> float:
    """The x in [low, high] where the increasing `fn` reaches `target`, by bisection to `tolerance`;
    `low` when fn(low) is already there, `high` when even fn(high) falls short."""
    if fn(low) >= target:
        return low
    if fn(high) <= target:
        return high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if fn(middle) < target else (low, middle)
    return (low + high) / 2


def _prefill_scale(profile: Profile, measured: list[Probe], output_tokens: int, host: SimConfig) -> float:
    """The least-squares slope of measured over simulated TTFT through the per-length medians: how
    many times as fast measured TTFT grows with the prompt (its intercept is route's, `_fixed_part`)."""
    medians = _per_length_medians([m.prompt_tokens for m in measured], [m.ttft_s for m in measured])
    if len(medians) < 2:
        return 1.0
    sim = [_alone(profile, Probe(n, 0.0, 0.0, 0.0), output_tokens, host).ttft_s for n in medians]
    sim_mean, measured_mean = statistics.fmean(sim), statistics.fmean(medians.values())
    spread = sum((x - sim_mean) ** 2 for x in sim)
    if spread <= 0:
        return 1.0
    slope = sum((x - sim_mean) * (y - measured_mean) for x, y in zip(sim, medians.values(), strict=True)) / spread
    low, high = PREFILL_SCALE_RANGE
    return min(max(slope, low), high)


def _measured_prefill(bare: Profile, prefill_steps: Sequence[tuple[int, float]], step_s: float) -> tuple[float, float]:
    """(fixed seconds per step, scale): the line through the prefill steps' times (less the step
    overhead) against their profiled times, by Theil-Sen (the median of the slopes between steps of
    different lengths, then the median intercept), which a stray slow step does not move. A worker's
    own threads cost its engine per operator (the GIL handed back and forth), and a prefill runs as many
    operators for 32 tokens as for 512: a ratio alone (the median of time over profiled time, as this
    was) read the middle lengths and left the simulation 3-8 ms slow at 384-512 tokens and fast at
    32-128 (lines through one cluster's probes had 0.4-2.8 ms fixed per step). One
    length, or a fixed part below 0: the median ratio, nothing fixed. The probes run alone, so the host
    stretches none of them (its model adds no core to one busy engine)."""
    cost = bare.step_cost(1)
    points = [(cost.seconds(n, 1, prefill_pairs(0, n)), seconds - step_s) for n, seconds in prefill_steps]
    low, high = PREFILL_SCALE_RANGE
    ratio = min(max(statistics.median(y / x for x, y in points), low), high)
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1]
    if not slopes:
        return 0.0, ratio
    slope = min(max(statistics.median(slopes), low), high)
    fixed_s = statistics.median(y - slope * x for x, y in points)
    return (fixed_s, slope) if fixed_s >= 0 else (0.0, ratio)


def _per_length_medians(lengths: list[int], values: list[float]) -> dict[int, float]:
    by_length: dict[int, list[float]] = {}
    for length, value in zip(lengths, values, strict=True):
        by_length.setdefault(length, []).append(value)
    return {length: statistics.median(v) for length, v in sorted(by_length.items())}


def _route_and_wake(lengths: list[int], idles_s: list[float], extra_s: list[float]) -> tuple[float, float]:
    """(route, idle wake-up) from the probes' unexplained TTFT: with probes sent after two or more
    idle times, the least-squares line of the per-idle-level medians against ln(1 + idle / tau)
    (Overheads.wake_s's shape; levels weighted by their probes): route its intercept (no idle), the
    wake-up its slope. One idle time, or a slope below 0: route `_fixed_part`, no wake-up."""
    levels: list[list[int]] = []  # probe indices, grouped by idle time (within 20% of each other)
    for i in sorted(range(len(idles_s)), key=lambda i: idles_s[i]):
        if levels and idles_s[i] <= 1.2 * idles_s[levels[-1][0]]:
            levels[-1].append(i)
        else:
            levels.append([i])
    if len(levels) < 2:
        return _fixed_part(lengths, extra_s), 0.0
    x = [statistics.median(math.log1p(idles_s[i] / IDLE_WAKE_TAU_S) for i in level) for level in levels]
    y = [statistics.median(extra_s[i] for i in level) for level in levels]
    w = [len(level) for level in levels]
    x_mean, y_mean = (sum(a * b for a, b in zip(w, v, strict=True)) / sum(w) for v in (x, y))
    spread = sum(wi * (xi - x_mean) ** 2 for wi, xi in zip(w, x, strict=True))
    slope = sum(wi * (xi - x_mean) * (yi - y_mean) for wi, xi, yi in zip(w, x, y, strict=True)) / spread
    if slope <= 0:
        return _fixed_part(lengths, extra_s), 0.0
    return max(y_mean - slope * x_mean, 0.0), slope


def _fixed_part(lengths: list[int], extra_s: list[float]) -> float:
    """The mean of the per-length medians of `extra_s` (>= 0), each length weighing the same. For route
    that is the intercept of the prefill scale's fit; the smallest median, which this once was, reads
    low by the noise of the lengths it picks from (a 0.9 ms route from four lengths where two gave 6-10)."""
    return max(statistics.fmean(_per_length_medians(lengths, extra_s).values()), 0.0)


def format_rows(rows: list[dict], overheads: Overheads) -> str:
    lines = [f"{'prompt':>7} {'TTFT ms':>9} {'sim':>9} {'gap ms':>8} {'sim':>8} {'tok ms':>8} {'sim':>8}"]
    lines += [
        f"{r['prompt_tokens']:>7} {r['ttft_ms']:>9.1f} {r['sim_ttft_ms']:>9.1f} {r['gap_ms']:>8.1f} "
        f"{r['sim_gap_ms']:>8.1f} {r['per_token_ms']:>8.2f} {r['sim_per_token_ms']:>8.2f}"
        for r in rows
    ]
    lines.append(
        f"overheads: route {overheads.route_s * 1e3:.1f} ms, adopt {overheads.adopt_s * 1e3:.1f} ms, "
        f"step {overheads.step_s * 1e3:.2f} ms, prefill steps x{overheads.prefill_step_scale:.2f} "
        f"+ {overheads.prefill_step_s * 1e3:.2f} ms, "
        f"decode steps x{overheads.decode_step_scale:.2f}, "
        f"idle wake-up {overheads.idle_wake_s * 1e3:.2f} ms x ln(1 + idle / {IDLE_WAKE_TAU_S:g} s)"
    )
    for name, jitter in (("route", overheads.route_jitter_s), ("adopt", overheads.adopt_jitter_s)):
        if len(jitter) >= 2:
            q = statistics.quantiles([v * 1e3 for v in jitter], n=10, method="inclusive")
            top_ms = max(jitter) * 1e3
            lines.append(f"{name} jitter ms: p10 {q[0]:+.1f}, p50 {q[4]:+.1f}, p90 {q[8]:+.1f}, max {top_ms:+.1f}")
    return "\n".join(lines)
