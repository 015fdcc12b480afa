"""Does a hand-off slow the prefill that overlaps it? A probe of what the fleet simulator leaves out.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_handoff_overlap [--rounds 10] [--prompt 256]

On a warm 1P1D cluster of the validation model (benchmarks/validate_sim.py's, one torch thread per
worker), the first-token time of a `--prompt`-token request B, in four arms taken in turn each round,
each after 0.5 s idle:
- alone: B by itself;
- after_handoff: B sent the moment another request A (same length) gets its first token, A asking
  for 2 tokens: A's KV is handed off to the decode worker while B prefills;
- after_no_handoff: the same with A asking for 1 token: A ends at prefill, nothing is handed off;
- after_stream: A asks for 32 tokens: its hand-off, then its decode stream, overlap B.
after_handoff - after_no_handoff is what a hand-off costs the prefill it overlaps (the simulator
charges a hand-off latency, not CPU). Medians and every sample are printed (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

ARMS = {"alone": 0, "after_handoff": 2, "after_no_handoff": 1, "after_stream": 32}  # A's max tokens
IDLE_S = 0.5


async def measure(target: str, vocab: tuple[int, ...], rounds: int, prompt_tokens: int) -> dict[str, list[float]]:
    from splitserve_client.client import AsyncClient

    counter = itertools.count(500_000)  # past the warm-up's prompt indices

    def prompt() -> list[int]:  # distinct prompts: nothing is served from the prefix cache
        i = next(counter)
        return [vocab[(i * 7919 + j * 104729) % len(vocab)] for j in range(prompt_tokens)]

    async with AsyncClient(target, max_retries=0) as client:

        async def first_token_s(tokens: list[int], max_tokens: int) -> float:
            sent_s, first_s = time.perf_counter(), None
            async for _ in client.generate_stream(tokens, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                first_s = first_s or time.perf_counter() - sent_s
            assert first_s is not None, "the stream ended without a token"
            return first_s

        async def after(a_max_tokens: int) -> float:
            stream = client.generate_stream(prompt(), max_tokens=a_max_tokens, temperature=0.0, ignore_eos=True)
            chunks = stream.__aiter__()
            await chunks.__anext__()  # A's first token: B goes now
            b = asyncio.ensure_future(first_token_s(prompt(), 4))
            async for _ in chunks:
                pass
            return await b

        samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(rounds):
            for arm, a_max_tokens in ARMS.items():
                await asyncio.sleep(IDLE_S)
                seconds = await (first_token_s(prompt(), 4) if a_max_tokens == 0 else after(a_max_tokens))
                samples[arm].append(seconds * 1e3)
    return samples


async def main_async(args) -> None:
    from benchmarks.validate_sim import validation_model
    from benchmarks.warm_cluster import warm_up
    from cluster.launcher import launch
    from common.config import ClusterConfig, PoolConfig, RouterConfig
    from loadtest.plan import ModelLimits
    from router.server import RouterServer
    from splitserve_client.client import AsyncClient

    config = ClusterConfig(
        prefill=PoolConfig(replicas=1, num_cpus=1.0, threads=1),
        decode=PoolConfig(replicas=1, num_cpus=1.0, threads=1),
        router=RouterConfig(port=0, http_port=None),
        ray_num_cpus=8,
    )
    model_dir = args.model or validation_model()
    cluster = await asyncio.get_running_loop().run_in_executor(None, launch, config, model_dir)
    try:
        server = await RouterServer.start(cluster, config)
        try:
            async with AsyncClient(server.address) as client:
                vocab = ModelLimits.from_model_info(await client.model_info()).ordinary_token_ids
            await warm_up(server.address, vocab, 2, 2)
            samples = await measure(server.address, vocab, args.rounds, args.prompt)
        finally:
            await server.stop(1.0)
    finally:
        cluster.shutdown()
    for arm, values in samples.items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        print(f"{arm:>17}: median {statistics.median(values):6.1f} ms  [{shown}]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of A and B")
    parser.add_argument("--model", help="checkpoint directory (default: validate_sim's shrunken demo model)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.prompt < 1:
        parser.error("--rounds and --prompt must be >= 1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
