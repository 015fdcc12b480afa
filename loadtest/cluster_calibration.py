"""Calibrating a profile against a running cluster on this host, every figure the simulator needs.

`calibrate_cluster` sends `CALIBRATION_LENGTHS` sequential probes (`loadtest/calibrate.py`: each after
one of `CALIBRATION_IDLES_S` idle in turn, the gaps Poisson arrivals at 1-4/s leave, so that the wake-up
after idle is fitted beside route) and fits the cluster overheads. When
the simulation shares the host's cores it also measures the host (`loadtest/host_cpu.py`): the cores
busy while the cluster idles, the CPU streaming costs per decode step and per token, and streaming's
interference with the engines, from the probes' CPU time and bursts of requests sent at once (and the
prefill engines' extra interference from prompts sent while others stream). The
overheads and the host's figures depend on each other (the engines' busy time under the overheads is
what the streaming fit subtracts; the host's stretch is what the overheads must not count again), so
they are fitted in turn from the one set of measurements until neither moves by more than
`HOST_FIT_TOLERANCE` (a fixed-point iteration: on simulated measurements it closes about half the
remaining gap per round, within 1% in 10 rounds; `HOST_FIT_MAX_ROUNDS` bounds it).

The streaming figures are the software's (the workers' outbox and poll threads, the router relaying
tokens, the client reading them), not the cluster shape's, and the bursts that separate them are
the noisiest part of a calibration: a calibration of another shape on the same host can take them
from an earlier one (`streaming`) and fit only its overheads, its idle cores and the overlaps' figures
(`loadtest/overlaps.py`: the prefill interference and the hand-off cores): a prefill engine's loss to
the decode streams beside it grows with the workers sharing the cores (one prefill worker and one
decode instance lose least), and its overlaps take a few seconds.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from engine.step_log import StepRecord
from loadtest.calibrate import fit_overheads, format_rows
from loadtest.host_cpu import (
    BURST_FIRST_INDEX,
    BurstSample,
    CpuSample,
    engines_of,
    fit_stream_costs,
    idle_cores,
    measure_bursts,
)
from loadtest.overlaps import OVERLAP_FIRST_INDEX, Overlap, fit_overlaps, measure_overlaps
from loadtest.probes import Probe, measure
from sim.config import SimConfig
from sim.profile import Overheads, Profile
from sim.seq import SimRequest

CALIBRATION_LENGTHS = [(64, 128, 256, 384)[i % 4] for i in range(32)]  # 8 probes per length
CALIBRATION_WARMUP = 2
CALIBRATION_IDLES_S = (0.1, 0.5, 2.0)
PROBE_OUTPUT_TOKENS = 16
HOST_FIT_MAX_ROUNDS = 30
HOST_FIT_TOLERANCE = 0.002  # relative change of the step overhead and of the streaming CPU per token
STREAMING_FIGURES = ("host_stream_cpu_per_step_s", "host_stream_cpu_per_token_s", "host_stream_interference")
# Fitted on every shape, streaming figures given or not: the idle cores and the overlaps' figures
# (loadtest/overlaps.py; a 1P1D fit used on every shape: the TTFTs of prompts sent
# while others streamed read 10-19 ms (median) above the simulated on 2P1D and 1P2D, 0-5 ms on 1P1D).
OVERLAP_FIGURES = ("host_prefill_interference", "host_handoff_cores")
HOST_FIGURES = ("host_background_cores", *STREAMING_FIGURES, *OVERLAP_FIGURES)
# Prompt indices one calibration uses from its prompt_index on (probes there, bursts and overlaps from
# BURST_FIRST_INDEX and OVERLAP_FIRST_INDEX past it): the spacing of calibrations of one cluster.
CALIBRATION_PROMPTS = 10_000


class PoolReading(Protocol):
    """One pool's engines so far: summed step seconds and steps, and the workers' newest step records."""

    @property
    def seconds(self) -> float: ...
    @property
    def steps(self) -> int: ...
    @property
    def recent(self) -> tuple[StepRecord, ...]: ...


# Reads each pool's engines: {"prefill": PoolReading, "decode": PoolReading} (benchmarks/engine_busy.py).
EngineSteps = Callable[[], Awaitable[Mapping[str, PoolReading]]]


class ClusterCalibration(NamedTuple):
    profile: Profile  # the given profile with the fitted overheads
    host: SimConfig | None  # its HOST_FIGURES set; None: the host was not measured
    rows: list[dict]  # the probes, measured beside simulated (`format_rows`)
    idle_cores: float  # measured busy cores while idle (0 when the host was not measured)


async def calibrate_cluster(
    target: str,
    profile: Profile,
    vocab: tuple[int, ...],
    host_cores: int | None,
    background_cores: float | None = None,
    shape: tuple[int, int] = (1, 1),
    streaming: SimConfig | None = None,
    probe_lengths: list[int] = CALIBRATION_LENGTHS,
    engine_steps: EngineSteps | None = None,
    prompt_index: int = 0,
) -> ClusterCalibration:
    """The overheads of the cluster at `target`, whose pools have `shape` (prefill workers, decode
    instances): the probes and bursts are simulated on it; with `host_cores`, the host's figures too
    (`background_cores`: given instead of measured). `streaming`: a calibration's host whose streaming
    figures (STREAMING_FIGURES) are taken as they are: no bursts, the overheads fitted once on them,
    then the overlaps' figures (OVERLAP_FIGURES) on this shape's overlaps.
    `probe_lengths`: the sequential probes' prompt lengths (fewer: a coarser fit, sooner).
    `engine_steps`: reads the pools' summed engine step seconds and steps (benchmarks/engine_busy.py's
    `pool_steps` on a cluster launched with metrics ports); with it the decode and prefill step scales
    and the step overhead are measured over the probes (loadtest/calibrate.py), else fitted. `prompt_index`: where
    the probes' and bursts' prompt indices start; a later calibration of the same cluster passes one
    past an earlier's (CALIBRATION_PROMPTS further), or its prompts hit the prefix cache."""
    pools = SimConfig(prefill=shape[0], decode=shape[1])
    idle = await idle_cores() if host_cores else 0.0
    measured, engines = await _probe(target, vocab, probe_lengths, engine_steps, prompt_index)
    decode_step_s, prefill_steps = (engines.decode_step_s, engines.prefill_steps) if engines else (None, ())
    if not host_cores:
        overheads, rows = fit_overheads(profile, measured, PROBE_OUTPUT_TOKENS, pools, decode_step_s, prefill_steps)
        return ClusterCalibration(profile.with_overheads(overheads), None, rows, 0.0)
    background = idle if background_cores is None else background_cores
    host = dataclasses.replace(pools, host_cores=host_cores, host_background_cores=background)
    if streaming is not None:
        host = dataclasses.replace(host, **{key: getattr(streaming, key) for key in STREAMING_FIGURES})
        overheads, rows = fit_overheads(profile, measured, PROBE_OUTPUT_TOKENS, host, decode_step_s, prefill_steps)
        overlaps = await measure_overlaps(target, vocab, OVERLAP_FIRST_INDEX + prompt_index)
        host = fit_overlaps(profile.with_overheads(overheads.fixed()), host, overlaps)
        return ClusterCalibration(profile.with_overheads(overheads), host, rows, idle)
    bursts = await measure_bursts(target, vocab, BURST_FIRST_INDEX + prompt_index)
    overlaps = await measure_overlaps(target, vocab, OVERLAP_FIRST_INDEX + prompt_index)
    sequential = in_flight_sample(measured, engines)
    overheads, rows, host = fit_in_turn(
        profile, measured, sequential, bursts, host, decode_step_s, overlaps, prefill_steps
    )
    return ClusterCalibration(profile.with_overheads(overheads), host, rows, idle)


def in_flight_sample(probes: list[Probe], engines: EngineTime | None = None) -> CpuSample:
    """The sequential probes as a CPU sample: the host's busy CPU while each was in flight, summed
    (warm-ups excluded: they pay one-time costs), and the engines' measured step time over them when
    read. Counting the whole window instead took in ~17 s of idle gaps between ~3.5 s of probes, and
    the background's error over them (a few hundredths of a core, ~1 CPU-second) rivalled the ~1.5
    CPU-seconds the probes' streaming cost."""
    rounds = [[SimRequest(0.0, p.prompt_tokens, PROBE_OUTPUT_TOKENS)] for p in probes]
    busy_s, window_s = sum(p.busy_cpu_s for p in probes), sum(p.wall_s for p in probes)
    if engines is None:
        return CpuSample(rounds, busy_s, window_s)
    return CpuSample(rounds, busy_s, window_s, engines.seconds, engines.steps, engines.decode_steps)


class EngineTime(NamedTuple):
    """The engines between two `EngineSteps` readings: all pools' step seconds and steps, the decode
    pool's steps, the median of its batch-1 steps among `decode_records` (the records read while the
    probes ran; a mean would count the step that adopts a sequence, whose import of the KV the
    simulator charges to adopt instead), and the prefill steps among `prefill_records` that each
    prefilled one fresh prompt (or its first chunk): (tokens, seconds)."""

    seconds: float
    steps: int
    decode_steps: int
    decode_step_s: float
    prefill_steps: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def between(
        before: Mapping[str, PoolReading],
        after: Mapping[str, PoolReading],
        decode_records: Iterable[StepRecord],
        prefill_records: Iterable[StepRecord] = (),
    ) -> EngineTime:
        seconds = sum(after[pool].seconds - before[pool].seconds for pool in after)
        steps = sum(after[pool].steps - before[pool].steps for pool in after)
        decode_steps = after["decode"].steps - before["decode"].steps
        batch_1 = [r.duration_s for r in decode_records if r.num_seqs == 1]
        if decode_steps <= 0 or not batch_1:
            raise ValueError("engine_steps: the decode pool recorded no batch-1 step during the probes")
        fresh = tuple(
            (r.num_tokens, r.duration_s)
            for r in prefill_records
            if r.num_seqs == 1 and r.context_tokens == r.num_tokens
        )
        return EngineTime(seconds, int(steps), int(decode_steps), statistics.median(batch_1), fresh)


async def _probe(
    target: str, vocab: tuple[int, ...], lengths: list[int], engine_steps: EngineSteps | None, first: int
) -> tuple[list[Probe], EngineTime | None]:
    """The sequential probes after their warm-ups (prompts from index `first` on), and the engines'
    step time over the probes alone (read between the two, and both pools' step records after every
    probe, those held before the first left out: a reading holds only the newest 64 per worker) when
    `engine_steps` is given."""
    options = (PROBE_OUTPUT_TOKENS, 0, CALIBRATION_IDLES_S)
    await measure(target, lengths[:CALIBRATION_WARMUP], vocab, None, *options, first)  # one-time costs
    if engine_steps is None:
        return await measure(target, lengths, vocab, None, *options, first + CALIBRATION_WARMUP), None
    # Per pool, ordered, each record once however many readings hold it (a worker's records are told
    # apart by their index and figures; two workers' identical records would merge, a negligible loss).
    records: dict[str, dict[StepRecord, None]] = {"prefill": {}, "decode": {}}

    async def collect() -> None:
        reading = await engine_steps()
        for pool, seen in records.items():
            seen.update(dict.fromkeys(reading[pool].recent))

    before = await engine_steps()
    earlier = {pool: set(before[pool].recent) for pool in records}  # held before the probes: left out
    measured = await measure(target, lengths, vocab, None, *options, first + CALIBRATION_WARMUP, collect)
    new = {pool: [r for r in seen if r not in earlier[pool]] for pool, seen in records.items()}
    engines = EngineTime.between(before, await engine_steps(), new["decode"], new["prefill"])
    if not engines.prefill_steps:  # as for the decode steps: asked to measure, it does not fall back
        raise ValueError("engine_steps: the prefill pool recorded no step of one fresh prompt during the probes")
    return measured, engines


def fit_in_turn(
    profile: Profile,
    measured: list[Probe],
    sequential: CpuSample,
    bursts: BurstSample,
    host: SimConfig,
    decode_step_s: float | None = None,
    overlaps: Sequence[Overlap] = (),
    prefill_steps: Sequence[tuple[int, float]] = (),
) -> tuple[Overheads, list[dict], SimConfig]:
    """(overheads, probe rows, `host` with its streaming figures): fitted in turn until they settle,
    starting from overheads fitted without a host model (on `host`'s pools), then the overlaps'
    figures on them (`fit_overlaps`; none: left as they are); `decode_step_s` and `prefill_steps` as
    `fit_overheads` takes them.
    The sequential probes and the bursts leave no hand-off beside a prefill, so the overlaps' figures
    move nothing the loop fits. The fits simulate the fixed overheads only (`Overheads.fixed`): the
    jitter's few draws would move their targets by chance."""
    measured_steps = (decode_step_s, prefill_steps)
    overheads, rows = fit_overheads(profile, measured, PROBE_OUTPUT_TOKENS, engines_of(host), *measured_steps)
    for _ in range(HOST_FIT_MAX_ROUNDS):
        before = (overheads.step_s, host.host_stream_cpu_per_token_s)
        costs = fit_stream_costs(profile.with_overheads(overheads.fixed()), sequential, bursts, host)
        host = dataclasses.replace(
            host,
            host_stream_cpu_per_step_s=costs.per_step_s,
            host_stream_cpu_per_token_s=costs.per_token_s,
            host_stream_interference=costs.interference,
        )
        overheads, rows = fit_overheads(profile, measured, PROBE_OUTPUT_TOKENS, host, *measured_steps)
        after = (overheads.step_s, host.host_stream_cpu_per_token_s)
        if all(abs(a - b) <= HOST_FIT_TOLERANCE * max(abs(a), 1e-9) for a, b in zip(after, before, strict=True)):
            break
    return overheads, rows, fit_overlaps(profile.with_overheads(overheads.fixed()), host, overlaps)


def host_report(host: SimConfig | None) -> dict:
    """`host`'s HOST_FIGURES for a report, in ms where they are times ({} for None)."""
    if host is None:
        return {}
    return {
        "cores": host.host_cores,
        "background_cores": host.host_background_cores,
        "stream_cpu_per_step_ms": host.host_stream_cpu_per_step_s * 1e3,
        "stream_cpu_per_token_ms": host.host_stream_cpu_per_token_s * 1e3,
        "stream_interference": host.host_stream_interference,
        "prefill_interference": host.host_prefill_interference,
        "handoff_cores": host.host_handoff_cores,
    }


def describe(calibration: ClusterCalibration) -> str:
    lines = [format_rows(calibration.rows, calibration.profile.overheads)]
    host = calibration.host
    if host is not None:
        lines.append(
            f"host: {calibration.idle_cores:.2f} cores busy while idle (simulated: {host.host_background_cores:.2f}); "
            f"streaming CPU {host.host_stream_cpu_per_step_s * 1e3:.2f} ms per decode step + "
            f"{host.host_stream_cpu_per_token_s * 1e3:.2f} ms per token, felt by the engines "
            f"x{host.host_stream_interference:.2f}, by prefill engines x{host.host_prefill_interference:.2f} more; "
            f"a hand-off keeps {host.host_handoff_cores:.2f} cores busy"
        )
    return "\n".join(lines)
