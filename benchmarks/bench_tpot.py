"""Decode TPOT while long prompts keep arriving: disaggregated vs colocated, same requests, same run.

`python -m benchmarks.bench_tpot` (inside scripts/in_sandbox.sh). The workload: `--streams` decode-heavy
requests (short prompt, `--stream-tokens` output) start at t=0; meanwhile a long prompt
(`--long-prompt` tokens, 1 output token) arrives every `--long-every-s` seconds. TPOT is measured on
the decode-heavy streams as the gaps between consecutive tokens as the caller receives them.

- colocated: one engine with `--threads` (default 2) torch threads in this process — long prefills
  share steps with the decodes, so a 512-token chunk stalls every decoding stream;
- disaggregated: one prefill actor and one decode actor with 1 thread each (the same two cores).

Both arms are also judged at the same SLO (`--ttft-slo-ms`, `--tpot-slo-ms`) over every request, long
and short: TTFT is from the moment a request is due to its first token (a colocated request due during
a step waits for it, as it would in a serving loop); a request's TPOT is its mean time per output token
after the first; it meets the SLO when both are within it (a one-token request has no TPOT). Goodput is
requests meeting the SLO per second of the run (first arrival to last token); attainment the share
of requests meeting it. The ratios compare arms of the same run (a shared host is noisy: absolute figures
drift between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from typing import NamedTuple

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def _workload(args) -> list[tuple[float, list[int], SamplingParams]]:
    rng = random.Random(args.seed)
    vocab = 4000
    items: list[tuple[float, list[int], SamplingParams]] = []
    stream = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
    items.extend((0.0, [rng.randrange(10, vocab) for _ in range(32)], stream) for _ in range(args.streams))
    long_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    at_s = args.long_every_s
    while at_s < args.duration_s:
        items.append((at_s, [rng.randrange(10, vocab) for _ in range(args.long_prompt)], long_params))
        at_s += args.long_every_s
    return items


class Timing(NamedTuple):
    due_s: float  # when the request arrived (perf_counter)
    token_times_s: tuple[float, ...]  # when each output token reached the caller (perf_counter)
    stream: bool  # a decode-heavy stream (short prompt), not a long prompt


def slo_report(timings: list[Timing], ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
    """TTFT percentiles, goodput and SLO attainment over every request (see the module docstring)."""
    ttfts_ms = sorted((t.token_times_s[0] - t.due_s) * 1e3 for t in timings)
    met = 0
    for t in timings:
        first, last, n = t.token_times_s[0], t.token_times_s[-1], len(t.token_times_s)
        tpot_ms = (last - first) / (n - 1) * 1e3 if n > 1 else 0.0
        met += (first - t.due_s) * 1e3 <= ttft_slo_ms and tpot_ms <= tpot_slo_ms
    span_s = max(t.token_times_s[-1] for t in timings) - min(t.due_s for t in timings)
    pick = lambda q: ttfts_ms[min(len(ttfts_ms) - 1, int(q * len(ttfts_ms)))]  # noqa: E731
    return {
        "ttft_p50_ms": pick(0.50),
        "ttft_p99_ms": pick(0.99),
        "goodput_per_s": met / span_s,
        "slo_attainment": met / len(timings),
        "num_requests": len(timings),
    }


def _gaps_s(timings: list[Timing]) -> list[float]:
    return [b - a for t in timings if t.stream for a, b in itertools.pairwise(t.token_times_s)]


def _percentiles(gaps_s: list[float]) -> dict:
    ordered = sorted(gaps_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {
        "tpot_p50_ms": pick(0.50),
        "tpot_p99_ms": pick(0.99),
        "tpot_mean_ms": statistics.mean(ordered) * 1e3,
        "num_gaps": len(ordered),
    }


def run_colocated(model_dir: str, items, threads: int) -> list[Timing]:
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_threads=threads, max_num_batched_tokens=1024))
    pending = sorted(enumerate(items), key=lambda x: x[1][0])
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
    timings = []
    for seq_id in list(engine.seqs):
        seq = engine.pop_finished(seq_id)
        at_s, _, params = items[int(seq_id[1:])]
        timings.append(Timing(started_s + at_s, tuple(seq.token_times_s), params.max_tokens > 1))
    return timings


async def _disagg_requests(cluster, items) -> list[Timing]:
    from cluster.client import ClusterClient
    from common.messages import GenerateRequest

    client = ClusterClient(cluster)
    started_s = time.perf_counter()

    async def one(index, at_s, prompt, params) -> Timing:
        await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - started_s)))
        times = []
        async for chunk in client.generate(GenerateRequest(f"d{index}", tuple(prompt), params)):
            now_s = time.perf_counter()
            times += [now_s] * len(chunk.token_ids)
        return Timing(started_s + at_s, tuple(times), params.max_tokens > 1)

    timings = await asyncio.gather(*(one(i, *item) for i, item in enumerate(items)))
    await client.close()
    return list(timings)


def run_disaggregated(model_dir: str, items) -> list[Timing]:
    from cluster.launcher import launch
    from common.config import ClusterConfig, PoolConfig

    pool = PoolConfig(num_cpus=1, threads=1, max_num_batched_tokens=1024)
    cluster = launch(ClusterConfig(prefill=pool, decode=pool, ready_timeout_s=180), model_dir)
    try:
        return asyncio.run(asyncio.wait_for(_disagg_requests(cluster, items), 900))
    finally:
        cluster.shutdown()


def _rows(timings: dict[str, list[Timing]], args) -> dict:
    return {
        arm: {**_percentiles(_gaps_s(t)), **slo_report(t, args.ttft_slo_ms, args.tpot_slo_ms)}
        for arm, t in timings.items()
    }


def _print(summary: dict, args) -> None:
    print(f"SLO: TTFT {args.ttft_slo_ms:g} ms, TPOT {args.tpot_slo_ms:g} ms (every request, long and short)")
    print(f"{'':14}{'TPOT p50':>9}{'p99':>8}{'mean':>8}{'TTFT p50':>10}{'p99':>8}{'goodput/s':>10}{'attain':>8}")
    for name in ("colocated", "disaggregated"):
        r = summary[name]
        print(
            f"{name:14}{r['tpot_p50_ms']:9.1f}{r['tpot_p99_ms']:8.1f}{r['tpot_mean_ms']:8.1f}{r['ttft_p50_ms']:10.0f}"
            f"{r['ttft_p99_ms']:8.0f}{r['goodput_per_s']:10.2f}{r['slo_attainment']:8.0%}"
        )
    print(
        f"disaggregated/colocated TPOT p99 ratio: {summary['p99_ratio']:.2f} (target <= 0.5), "
        f"p50 ratio: {summary['p50_ratio']:.2f}; goodput ratio: "
        + (
            "n/a (no colocated request met the SLO)"
            if summary["goodput_ratio"] is None
            else f"{summary['goodput_ratio']:.2f}"
        )
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--long-every-s", type=float, default=1.0)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO of every request")
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT SLO of every multi-token request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from engine.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    items = _workload(args)
    rows = _rows(
        {
            "colocated": run_colocated(model_dir, items, args.threads),
            "disaggregated": run_disaggregated(model_dir, items),
        },
        args,
    )
    colocated, disaggregated = rows["colocated"], rows["disaggregated"]
    summary = {
        **rows,
        "p99_ratio": disaggregated["tpot_p99_ms"] / colocated["tpot_p99_ms"],
        "p50_ratio": disaggregated["tpot_p50_ms"] / colocated["tpot_p50_ms"],
        # None when no colocated request met the SLO: any goodput is infinitely many times none
        "goodput_ratio": (
            disaggregated["goodput_per_s"] / colocated["goodput_per_s"] if colocated["goodput_per_s"] > 0 else None
        ),
        "args": {**vars(args), "model": args.model or "demo"},
    }  # no local paths in reports
    _print(summary, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return summary


if __name__ == "__main__":
    main()
