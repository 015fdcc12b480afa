"""Prefix pull vs recompute on real prefill actors: what a pulled prefix saves, per prefix length.

`scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_pull` launches 2 prefill actors and 1
decode actor (the demo model unless `--model`, 1 torch thread each). For each prefix length, worker 0
computes a prompt with that prefix; then worker 1 gets, alternating, `--repeats` times each:
  pull:      prefix + a fresh 16-token tail, pulling the prefix from worker 0 (mode "always");
  recompute: a fresh prompt of the same length, computed in full;
and the time to the first token as the prefill worker reports it (queue + pull + compute) is compared
(median, same run). Also printed: the pull alone (ms, GB/s) and what the router's prior would have
estimated for it (policies/prefix_pull.py PULL_PRIOR); the router refits it from real pulls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time

from cluster.client import ClusterClient
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig
from common.messages import GenerateRequest, PrefixPull
from engine import SamplingParams
from policies.prefix_pull import PULL_PRIOR

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
TAIL_TOKENS = 16


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def _ttft_s(client: ClusterClient, cluster, request: GenerateRequest, worker: int):
    """(seconds to the first token as the caller sees it, the first chunk)."""
    started_s = time.perf_counter()
    async with contextlib.aclosing(client.generate(request, prefill=cluster.prefill[worker])) as chunks:
        async for chunk in chunks:  # max_tokens 1: the first chunk is the last; closing runs its cleanup
            return time.perf_counter() - started_s, chunk
    raise RuntimeError(f"{request.request_id}: the stream ended without a token")


async def _measure(client: ClusterClient, cluster, length: int, repeats: int, rng: random.Random) -> dict:
    vocab, block = cluster.prefill[0].info.vocab_size, cluster.prefill[0].info.block_size
    pulled_s, computed_s, pulls = [], [], []
    for i in range(repeats):  # a fresh prefix each time: worker 1 must not hold it from a previous pull
        prefix = _tokens(rng, length, vocab)
        await _ttft_s(client, cluster, GenerateRequest(f"seed-{length}-{i}", (*prefix, 11), ONE_TOKEN), 0)
        pull = PrefixPull(cluster.prefill[0].worker_id, length // block)
        prompt = tuple(prefix + _tokens(rng, TAIL_TOKENS, vocab))
        seconds, chunk = await _ttft_s(
            client, cluster, GenerateRequest(f"pull-{length}-{i}", prompt, ONE_TOKEN, prefix_pull=pull), 1
        )
        if chunk.pull.num_blocks != length // block:
            raise RuntimeError(f"pull of {length} tokens moved {chunk.pull.num_blocks} blocks: {chunk.pull}")
        pulled_s.append(seconds)
        pulls.append(chunk.pull)
        fresh = tuple(_tokens(rng, length + TAIL_TOKENS, vocab))
        computed_s.append(
            (await _ttft_s(client, cluster, GenerateRequest(f"full-{length}-{i}", fresh, ONE_TOKEN), 1))[0]
        )
    return {
        "pulled_s": statistics.median(pulled_s),
        "computed_s": statistics.median(computed_s),
        "pull_s": statistics.median(p.duration_s for p in pulls),
        "num_bytes": pulls[0].num_bytes,
    }


async def _run(cluster, lengths: list[int], repeats: int, seed: int) -> list[dict]:
    client, rng = ClusterClient(cluster), random.Random(seed)
    try:
        await _measure(client, cluster, lengths[0], 1, rng)  # warm-up: channels, kernels, allocator
        return [{"length": n, **await _measure(client, cluster, n, repeats, rng)} for n in lengths]
    finally:
        await client.close()


def _print(rows: list[dict]) -> None:
    print(
        "prefix tokens | KV MB | TTFT with pull ms | TTFT recomputed ms | ratio | pull alone ms | pull GB/s | "
        "prior estimate ms"
    )
    print("---: | ---: | ---: | ---: | ---: | ---: | ---: | ---:")
    for r in rows:
        print(
            f"{r['length']} | {r['num_bytes'] / 1e6:.1f} | {1000 * r['pulled_s']:.1f} | "
            f"{1000 * r['computed_s']:.1f} | "
            f"{r['pulled_s'] / r['computed_s']:.2f} | {1000 * r['pull_s']:.1f} | "
            f"{r['num_bytes'] / r['pull_s'] / 1e9:.2f} | {1000 * PULL_PRIOR.time_s(r['num_bytes']):.1f}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 1536])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats < 1 or any(n < 16 or n % 16 for n in args.lengths):
        p.error("--repeats must be >= 1 and --lengths multiples of 16 (whole blocks)")
    pool = PoolConfig(num_cpus=0.5, threads=1)
    config = ClusterConfig(prefill=PoolConfig(**{**pool.__dict__, "replicas": 2}), decode=pool)
    cluster = launch(config, args.model)
    try:
        _print(asyncio.run(_run(cluster, args.lengths, args.repeats, args.seed)))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
