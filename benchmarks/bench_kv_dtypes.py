"""KV cache dtypes at equal memory: blocks per pool, and prefix-cache hit rate on the Mooncake replay.

    python -m benchmarks.bench_kv_dtypes [--kv-cache-dtypes auto,int8,fp8] [--memory-gib 6]
        [--requests N] [--trace FILE] [--policies cache_aware] [--prefix-pull auto|always|never]

1. Blocks: `EngineConfig.num_blocks_for` of the demo model (fp32, 12 layers x 4 KV heads x head_dim
   64, block 16) under the same `kv_cache_memory_bytes` for each dtype, i.e. what a real pool holds.
2. Hit rate: `benchmarks.bench_prefix_routing`'s replay (the simulator running the router's own routing
   policy and prefix index over real block pools; modelled compute) of the conversation trace through 4
   prefill workers whose pools hold that many blocks each, with the router's prefix pulls
   (`--prefix-pull`, auto by default); its modelled KV transfers (hand-offs, pulls) move the dtype's
   bytes per token, and `pulled` is the share of prompt tokens pulled. The auto row at 6 GiB is the
   routing benchmark's 16,384-block setting (6 GiB / 384 KiB a block).
Hand-off latency and bytes per dtype: `benchmarks.bench_handoff --kv-cache-dtypes auto,int8,fp8`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from benchmarks.bench_prefix_routing import (
    DEFAULT_TRACE,
    PULL_MODES,
    load_requests,
    oracle_cached_tokens,
    parse_args,
    replay,
)
from engine.config import EngineConfig, ModelConfig, RopeConfig
from engine.kv_quant import kv_format

DEMO = ModelConfig(
    "LlamaForCausalLM", 4096, 768, 2048, 12, 12, 4, 64, 1e-6, 2048, RopeConfig(), False, False, False, "float32"
)


def blocks_for(kv_cache_dtype: str, memory_bytes: int) -> int:
    # A large max_num_seqs: the pool is sized by memory alone, as a serving pool of that memory is.
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=memory_bytes, max_num_seqs=1 << 20)
    return config.num_blocks_for(DEMO)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8")
    parser.add_argument("--memory-gib", type=float, default=6.0, help="KV memory per prefill worker")
    parser.add_argument("--requests", type=int, default=None, help="replay the first N trace rows (default: all)")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--policies", default="cache_aware", help="comma-separated routing policies")
    parser.add_argument("--prefix-pull", default="auto", choices=PULL_MODES, help="router.prefix_pull of the replays")
    args = parser.parse_args(argv)
    memory = int(args.memory_gib * 2**30)
    dtypes = args.kv_cache_dtypes.split(",")
    per_token = {
        d: kv_format(d, torch.float32).bytes_per_token(DEMO.num_layers, DEMO.num_kv_heads, DEMO.head_dim)
        for d in dtypes
    }
    blocks = {d: blocks_for(d, memory) for d in dtypes}
    print(f"demo model KV, {args.memory_gib:g} GiB per pool:")
    print(f"{'kv dtype':>9}{'bytes/token':>13}{'x fp32':>8}{'blocks':>10}{'x auto':>8}")
    for d in dtypes:
        print(
            f"{d:>9}{per_token[d]:>13}{per_token[d] / per_token.get('auto', per_token[d]):>8.3f}{blocks[d]:>10}"
            f"{blocks[d] / blocks.get('auto', blocks[d]):>8.2f}"
        )
    results: dict[str, dict] = {"bytes_per_token": per_token, "blocks": blocks, "hit_rate": {}}
    requests = notes = None
    for d in dtypes:
        route_argv = ["--trace", args.trace, "--blocks-per-worker", str(blocks[d])]
        if args.requests is not None:
            route_argv += ["--requests", str(args.requests)]
        route_args, fleet = parse_args(route_argv)
        if requests is None:  # the same requests (and speed-up) for every dtype
            requests, notes = load_requests(route_args)
            print(
                f"\nreplay: {len(requests)} requests, {notes['prompt_tokens']} prompt tokens, speed-up "
                f"{notes['speedup']:.2f}; oracle hit rate "
                f"{oracle_cached_tokens(requests, 16) / notes['prompt_tokens']:.3f}"
            )
            print(
                f"{'kv dtype':>9}{'policy':>14}{'blocks/worker':>15}{'hit rate':>10}{'x auto':>8}{'pulled':>8}"
                f"{'mean TTFT s':>13}{'wall s':>8}"
            )
        for policy in args.policies.split(","):
            started_s = time.perf_counter()
            dtype_fleet = replace(fleet, blocks_per_worker=blocks[d], kv_bytes_per_token=per_token[d])
            result = replay(policy, requests, dtype_fleet, args.prefix_pull)
            results["hit_rate"][(d, policy)] = result.hit_rate
            base = results["hit_rate"].get(("auto", policy))
            print(
                f"{d:>9}{policy:>14}{blocks[d]:>15}{result.hit_rate:>10.3f}"
                f"{(result.hit_rate / base if base else float('nan')):>8.2f}"
                f"{result.pulled_rate:>8.3f}{result.mean_ttft_s:>13.3f}"
                f"{time.perf_counter() - started_s:>8.1f}"
            )
    return results


if __name__ == "__main__":
    main()
