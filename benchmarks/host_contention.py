"""How one engine's step time stretches when other busy engine processes share its host.

    .venv/bin/python -m benchmarks.host_contention [--others 0,1,2,3] [--steps 40] [--threads 1]

The fleet simulator's host-sharing model (sim/contention.py) says a step takes its profiled
time x max(1, busy processes / host cores). This measures that on this machine: a timed process runs
the validation model's steps (a 256-token prefill chunk and an 8-sequence decode step, alternating)
while `k` other processes run the same engine's steps flat out; every process has `--threads` torch
threads, as a cluster worker does. Printed per k: the median step times, their ratio to k = 0 (the
baseline, measured in the same run) and the model's stretch. Other jobs on a shared box stretch
every row alike; `uptime`'s load average is printed beside the table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

PREFILL_TOKENS = 256
DECODE_BATCH = 8
DECODE_CONTEXT = 128


def _engine(model_dir: str, threads: int):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(model_dir=model_dir, num_kv_blocks=256, enable_prefix_caching=False, num_threads=threads)
    )


def _prefill_step_s(engine, rid: str) -> float:
    from engine.sampling_params import SamplingParams

    engine.add_request(rid, [5 + i % 50 for i in range(PREFILL_TOKENS)], SamplingParams(max_tokens=1))
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    engine.abort_request(rid)
    return elapsed


def _decode_step_s(engine, rids: list[str]) -> float:
    started = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - started
    if engine.last_step_shape[:2] != (DECODE_BATCH, DECODE_BATCH):
        raise RuntimeError(f"decode step was {engine.last_step_shape}, expected {DECODE_BATCH} rows")
    return elapsed


def _start_decodes(engine, tag: str, steps: int) -> list[str]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(DECODE_BATCH)]
    for rid in rids:
        engine.add_request(rid, [7 + i % 40 for i in range(DECODE_CONTEXT)], params)
    while any(engine.seqs[r].num_computed_tokens < DECODE_CONTEXT for r in rids):
        engine.step()
    return rids


def _busy(model_dir: str, threads: int, ready, stop) -> None:
    """Runs the same steps flat out until `stop` is set."""
    engine = _engine(model_dir, threads)
    ready.release()
    round_ = 0
    while not stop.is_set():
        round_ += 1
        _prefill_step_s(engine, f"busy-p{round_}")
        rids = _start_decodes(engine, f"busy-d{round_}", 8)
        for _ in range(8):
            engine.step()
        for rid in rids:
            engine.abort_request(rid)


def _timed(model_dir: str, threads: int, steps: int) -> tuple[float, float]:
    """(median prefill step, median decode step) in seconds, after one warm-up of each."""
    engine = _engine(model_dir, threads)
    _prefill_step_s(engine, "warm")
    prefill = [_prefill_step_s(engine, f"p{i}") for i in range(steps)]
    rids = _start_decodes(engine, "d", steps + 1)
    _decode_step_s(engine, rids)
    decode = [_decode_step_s(engine, rids) for _ in range(steps)]
    return statistics.median(prefill), statistics.median(decode)


def measure(model_dir: str, others: int, threads: int, steps: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Semaphore(0), ctx.Event()
    procs = [ctx.Process(target=_busy, args=(model_dir, threads, ready, stop), daemon=True) for _ in range(others)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise TimeoutError("a busy engine process did not start within 120 s")
        time.sleep(0.5)  # let them reach their loops
        return _timed(model_dir, threads, steps)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--others", default="0,1,2,3", help="busy engine processes beside the timed one")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the host's cores (the model's)")
    args = parser.parse_args(argv)
    from benchmarks.validate_sim import validation_model

    model_dir = validation_model()
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {args.cores} cores")
    print(f"{'others':>6} {'prefill ms':>11} {'ratio':>6} {'decode ms':>10} {'ratio':>6} {'model':>6}")
    base = None
    for others in (int(k) for k in args.others.split(",")):
        prefill_s, decode_s = measure(model_dir, others, args.threads, args.steps)
        base = base or (prefill_s, decode_s)
        model = max(1.0, (others + 1) * args.threads / args.cores)
        print(
            f"{others:>6} {prefill_s * 1e3:>11.2f} {prefill_s / base[0]:>6.2f} "
            f"{decode_s * 1e3:>10.2f} {decode_s / base[1]:>6.2f} {model:>6.2f}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
