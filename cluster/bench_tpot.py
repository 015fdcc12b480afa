"""Decode TPOT while long prompts keep arriving: disaggregated vs colocated, same requests, same run.

`python -m cluster.bench_tpot` (inside scripts/in_sandbox.sh). The workload: `--streams` decode-heavy
requests (short prompt, `--stream-tokens` output) start at t=0; meanwhile a long prompt
(`--long-prompt` tokens, 1 output token) arrives every `--long-every-s` seconds. TPOT is measured on
the decode-heavy streams as the gaps between consecutive tokens as the caller receives them.

- colocated: one engine with `--threads` (default 2) torch threads in this process — long prefills
  share steps with the decodes, so a 512-token chunk stalls every decoding stream;
- disaggregated: one prefill actor and one decode actor with 1 thread each (the same two cores).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def _workload(args) -> list[tuple[float, list[int], SamplingParams]]:
    rng = random.Random(args.seed)
    vocab = 4000
    items = []
    stream = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
    for _ in range(args.streams):
        items.append((0.0, [rng.randrange(10, vocab) for _ in range(32)], stream))
    long_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    at_s = args.long_every_s
    while at_s < args.duration_s:
        items.append((at_s, [rng.randrange(10, vocab) for _ in range(args.long_prompt)], long_params))
        at_s += args.long_every_s
    return items


def _percentiles(gaps_s: list[float]) -> dict:
    ordered = sorted(gaps_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"tpot_p50_ms": pick(0.50), "tpot_p99_ms": pick(0.99), "tpot_mean_ms": statistics.mean(ordered) * 1e3,
            "num_gaps": len(ordered)}


def run_colocated(model_dir: str, items, threads: int) -> dict:
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_threads=threads, max_num_batched_tokens=1024))
    pending = sorted(enumerate(items), key=lambda x: x[1][0])
    streams = {f"c{i}" for i, (at_s, _, p) in pending if p.max_tokens > 1}
    started_s = time.perf_counter()
    while pending or engine.has_unfinished():
        now_s = time.perf_counter() - started_s
        while pending and pending[0][1][0] <= now_s:
            index, (_, prompt, params) = pending.pop(0)
            engine.add_request(f"c{index}", prompt, params)
        if engine.has_unfinished():
            engine.step()
        else:
            time.sleep(0.001)
    gaps = []
    for seq_id in list(engine.seqs):
        seq = engine.pop_finished(seq_id)
        if seq_id in streams:
            gaps += [b - a for a, b in zip(seq.token_times_s, seq.token_times_s[1:])]
    return _percentiles(gaps)


async def _disagg_requests(cluster, items) -> list[float]:
    from cluster.client import ClusterClient
    from cluster.messages import GenerateRequest

    client = ClusterClient(cluster)
    started_s = time.perf_counter()
    gaps: list[float] = []

    async def one(index, at_s, prompt, params):
        await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - started_s)))
        times = []
        async for chunk in client.generate(GenerateRequest(f"d{index}", tuple(prompt), params)):
            now_s = time.perf_counter()
            times += [now_s] * len(chunk.token_ids)
        if params.max_tokens > 1:
            gaps.extend(b - a for a, b in zip(times, times[1:]))

    await asyncio.gather(*(one(i, *item) for i, item in enumerate(items)))
    await client.close()
    return gaps


def run_disaggregated(model_dir: str, items) -> dict:
    from cluster.config import ClusterConfig, PoolConfig
    from cluster.launcher import launch

    pool = PoolConfig(num_cpus=1, threads=1, max_num_batched_tokens=1024)
    cluster = launch(ClusterConfig(prefill=pool, decode=pool, ready_timeout_s=180), model_dir)
    try:
        gaps = asyncio.run(asyncio.wait_for(_disagg_requests(cluster, items), 900))
    finally:
        cluster.shutdown()
    return _percentiles(gaps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--long-every-s", type=float, default=1.0)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    items = _workload(args)
    colocated = run_colocated(args.model, items, args.threads)
    disaggregated = run_disaggregated(args.model, items)
    summary = {"colocated": colocated, "disaggregated": disaggregated,
               "p99_ratio": disaggregated["tpot_p99_ms"] / colocated["tpot_p99_ms"],
               "p50_ratio": disaggregated["tpot_p50_ms"] / colocated["tpot_p50_ms"], "args": vars(args)}
    print(f"{'':14}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name in ("colocated", "disaggregated"):
        row = summary[name]
        print(f"{name:14}{row['tpot_p50_ms']:10.1f}{row['tpot_p99_ms']:10.1f}{row['tpot_mean_ms']:10.1f}")
    print(f"disaggregated/colocated TPOT p99 ratio: {summary['p99_ratio']:.2f} (target <= 0.5), "
          f"p50 ratio: {summary['p50_ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return summary


if __name__ == "__main__":
    main()
