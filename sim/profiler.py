"""Measures a `Profile` on this machine: the real engine, timed over a grid of step shapes.

`measure_profile(model_dir, ...)` builds an `LLMEngine` in this process (the threads a pool worker
gets, `PoolConfig.threads`) and times `engine.step()`:
- prefill steps: one sequence computing a chunk of N tokens after S already computed, for N over
  `chunk_tokens` and S over `starts` (the scheduler's chunk size is set per step so each step is
  exactly that chunk);
- decode steps: b sequences of L tokens each decoding one token, for b over `batches` and L over
  `contexts`.
Each point is timed `repeats` times after a warm-up; the median goes into the fit over the knots
the grid covers
(sim/step_cost.py `fit_step_cost`), and the profile records the fit's RMS relative error.
A measured profile has tensor-parallel size 1 only (TP ranks are separate processes; the roofline
profiles model TP). KV capacity is what a pool worker gets from the cluster config's defaults.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.config import PoolConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model_config
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from sim.profile import ModelFacts, Overheads, Profile, Transfer
from sim.step_cost import StepSample, fit_step_cost, prefill_pairs

DEFAULT_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# The KV hand-off between two processes on this kind of machine (README "Hand-off latency": gloo on
# loopback, 12.6 MB in 17 ms, 50 MB in 35 ms); `splitserve profile --transfer-*` overrides it.
CPU_TRANSFER = Transfer(latency_s=0.008, bytes_per_s=1.4e9)


@dataclass(frozen=True)
class Grid:
    chunk_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    starts: tuple[int, ...] = (0, 256, 1024)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 5  # timed steps per point (the median is fitted): 3 left the fit's RMS error at 14-22%
    knots: tuple[int, ...] = DEFAULT_KNOTS

    @staticmethod
    def quick() -> Grid:
        """A small grid for tests and smoke runs (seconds on a tiny model)."""
        return Grid((8, 32, 128, 512), (0, 128), (1, 4, 16), (32, 128), 2, (1, 4, 16, 128, 512))


def measure_profile(
    model_dir: str,
    *,
    threads: int = 1,
    dtype: str = "auto",
    grid: Grid = Grid(),
    label: str | None = None,
    transfer: Transfer = CPU_TRANSFER,
    say: Callable[[str], None] = lambda _: None,
    device: str = "cpu",
    kv_cache_memory_bytes: int | None = None,
) -> Profile:
    """`device`: where the engine runs ("cuda" times a GPU); `kv_cache_memory_bytes`: a pool worker's KV
    memory, for the profile's capacity (default: the cluster config's, sized for CPU workers)."""
    engine = _engine(model_dir, threads, dtype, grid, device)
    samples = _prefill_samples(engine, grid, say) + _decode_samples(engine, grid, say)
    cost, rms = fit_step_cost(samples, _covered_knots(grid.knots, samples))
    model = engine.model_config
    pool = PoolConfig()
    cluster_engine = EngineConfig(
        model_dir=model_dir,
        dtype=dtype,
        max_num_seqs=pool.max_num_seqs,
        kv_cache_memory_bytes=kv_cache_memory_bytes or pool.kv_cache_memory_bytes,
    )
    capacity = cluster_engine.num_blocks_for(model) * cluster_engine.block_size
    params = sum(p.numel() for p in engine.runner.model.parameters())
    hardware = _hardware(engine, threads)
    kv_bytes = cluster_engine.kv_format(model).bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim)
    facts = ModelFacts(
        model.architecture,
        int(params),
        kv_bytes,
        engine.max_model_len,
        model.vocab_size,
        engine.config.block_size,
        tuple(model.eos_token_ids),
    )
    return Profile(
        "measured",
        label or f"measured on this machine: {model.architecture} {model.dtype}, {hardware}",
        hardware,
        facts,
        {1: cost},
        {1: capacity},
        transfer,
        Overheads(),
        _source(samples, rms, grid),
        threads,
    )


def _hardware(engine: LLMEngine, threads: int) -> str:
    device = engine.runner.device
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {threads} torch thread(s) per worker"


def _source(samples: list[StepSample], rms: float, grid: Grid) -> dict:
    return {
        "made_by": "splitserve profile",
        "created_unix_s": int(time.time()),
        "samples": len(samples),
        # The measured steps as fitted (tokens, seqs, prefill pairs, decode context, ms): a later model
        # of the step cost can be refitted without the hardware.
        "steps": [[s.tokens, s.seqs, s.prefill_pairs, s.decode_context, round(s.duration_s * 1e3, 4)] for s in samples],
        "fit_rms_relative_error": round(rms, 4),
        "grid": dataclasses.asdict(grid),
    }


def _covered_knots(knots: tuple[int, ...], samples: list[StepSample]) -> tuple[int, ...]:
    """The knots no larger than the largest step measured: a knot beyond every sample is unconstrained
    (the fit set it to 0 and bent dense(T) down past the last measured point)."""
    largest = max(s.tokens for s in samples)
    covered = tuple(k for k in knots if k <= largest)
    return covered if len(covered) >= 2 else (1, largest)


def _engine(model_dir: str, threads: int, dtype: str, grid: Grid, device: str = "cpu") -> LLMEngine:
    max_len = load_model_config(model_dir, dtype).max_position_embeddings
    longest = min(max(max(grid.starts) + max(grid.chunk_tokens), max(grid.contexts) + _decode_tokens(grid)), max_len)
    blocks = -(-longest // EngineConfig().block_size) * max(max(grid.batches), 1) + 8
    config = EngineConfig(
        model_dir=model_dir,
        role="colocated",
        dtype=dtype,
        num_kv_blocks=blocks,
        max_num_seqs=max(grid.batches),
        max_num_batched_tokens=max(grid.chunk_tokens),
        prefill_chunk_tokens=max(grid.chunk_tokens),
        enable_prefix_caching=False,
        num_threads=threads,
        device=device,
    )
    return LLMEngine(config)


def _set_chunk(engine: LLMEngine, tokens: int) -> None:
    limits = engine.scheduler.config
    engine.scheduler.config = SchedulerConfig(limits.max_num_seqs, max(tokens, limits.max_num_batched_tokens), tokens)


def _wait_for_device(engine: LLMEngine) -> None:
    """A step that samples nothing (a prompt's chunk short of its end) returns with its GPU work still
    queued; the next timed step would wait for it. Timed without this wait, a 16-token chunk after 16,384
    tokens reads 143 ms on an H200: the 16,384-token prefill before it, not the chunk."""
    device = engine.runner.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(engine: LLMEngine) -> tuple[float, tuple[int, int, int]]:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started, engine.last_step_shape


def _prefill_samples(engine: LLMEngine, grid: Grid, say) -> list[StepSample]:
    samples, params = [], SamplingParams(max_tokens=1, ignore_eos=True)
    for start in grid.starts:
        for chunk in (c for c in grid.chunk_tokens if start + c < engine.max_model_len):
            times = []
            for repeat in range(grid.repeats + 1):  # the first of each point warms it up
                rid = f"p-{start}-{chunk}-{repeat}"
                engine.add_request(rid, [5 + i % 50 for i in range(start + chunk)], params)
                if start:
                    _set_chunk(engine, start)
                    engine.step()
                    _wait_for_device(engine)
                _set_chunk(engine, chunk)
                duration_s, shape = _timed_step(engine)
                if shape != (chunk, 1, start + chunk):
                    raise RuntimeError(f"profile step was {shape}, expected {(chunk, 1, start + chunk)}")
                engine.abort_request(rid)
                times.append(duration_s)
            samples.append(StepSample(chunk, 1, prefill_pairs(start, chunk), 0, statistics.median(times[1:])))
        say(f"prefill steps after {start} tokens: done")
    return samples


def _decode_tokens(grid: Grid) -> int:
    """Output tokens a decode point's sequences may need: the first ones decode while the last prefill."""
    prefill_steps = -(-max(grid.batches) * max(grid.contexts) // max(grid.chunk_tokens))
    return prefill_steps + grid.repeats + 4


def _decode_samples(engine: LLMEngine, grid: Grid, say) -> list[StepSample]:
    samples, params = [], SamplingParams(max_tokens=_decode_tokens(grid), ignore_eos=True)
    _set_chunk(engine, max(grid.chunk_tokens))
    for context in (c for c in grid.contexts if c + _decode_tokens(grid) <= engine.max_model_len):
        for batch in grid.batches:
            rids = [f"d-{context}-{batch}-{i}" for i in range(batch)]
            for rid in rids:
                engine.add_request(rid, [7 + i % 40 for i in range(context - 1)], params)
            while any(engine.seqs[r].num_computed_tokens < context - 1 for r in rids):
                engine.step()  # prefill them (and sample each one's first token)
            engine.step()  # warm-up decode step
            times = []
            for _ in range(grid.repeats):
                duration_s, shape = _timed_step(engine)
                tokens, seqs, ctx = shape
                if (tokens, seqs) != (batch, batch):
                    raise RuntimeError(f"profile decode step was {shape} with {batch} sequences")
                times.append((duration_s, ctx))
            for rid in rids:
                engine.abort_request(rid)
            ctx = round(statistics.mean(c for _, c in times))
            samples.append(StepSample(batch, batch, 0.0, ctx, statistics.median(t for t, _ in times)))
        say(f"decode steps at context {context}: done")
    return samples
