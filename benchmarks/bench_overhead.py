"""What the router adds: per-request latency at a fixed request rate, and per streamed token, compared
with calling the cluster API (`ClusterClient`) directly — same cluster, same requests, same run.

`scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_overhead` launches 1 prefill + 1 decode actor
(a shrunken demo model unless `--model`, so the cluster keeps up with the rate) and serves a router on
this process's event loop, as `splitserve serve` does. Then it alternates rounds of two arms:
  direct: this process calls `ClusterClient.generate` itself;
  router: a separate client process (the SDK, like a real client) sends the same kind of requests
          over gRPC on loopback to the router in this process, which calls the same cluster API.
Arrivals are open-loop Poisson at `--rate` req/s with `--max-tokens 1` (routing, hashing, validation,
the prefill call and the reservation release, no decoding). Two figures for the request overhead:
  arm vs arm — latency percentiles of the router arm minus the direct arm;
  paired — per routed request, the latency its client saw minus the time the router spent waiting
           on the cluster API for that very request (the router's `splitserve-upstream-ms` trailer:
           same request, same moment, no cross-arm noise).
A third arm measures the floor under both: the same client process, rate and requests against a
do-nothing `Generate` (one message back at once, no router, no cluster) served on this process's loop —
what the gRPC hop alone costs on this machine, for reading the paired figure against.
The streaming round sends `--stream-requests` sequential requests of `--stream-tokens` tokens each
way and reports the difference in time per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import grpc

from cluster.client import ClusterClient
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig, RouterConfig
from common.messages import GenerateRequest
from engine import SamplingParams
from splitserve_client.protocol import splitserve_v1_pb2 as pb
from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def _open_loop(send, prompts, rate: float, seed: int) -> list[float]:
    """Sends prompt i at the i-th Poisson arrival; returns each request's latency in seconds."""
    rng = random.Random(seed)
    offsets, at_s = [], 0.0
    for _ in prompts:
        at_s += rng.expovariate(rate)
        offsets.append(at_s)
    started_s = time.perf_counter()

    async def one(index: int, offset_s: float, prompt) -> float:
        await asyncio.sleep(max(0.0, started_s + offset_s - time.perf_counter()))
        sent_s = time.perf_counter()
        await send(index, prompt)
        return time.perf_counter() - sent_s

    return list(await asyncio.gather(*(one(i, o, p) for i, (o, p) in enumerate(zip(offsets, prompts, strict=True)))))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def client_main(args) -> None:
    """A router arm's client process: one round of open-loop requests on one channel; prints
    {request id: [latency_s, upstream_s]} (upstream: the router's trailer; None from the floor server)."""
    from splitserve_client.client import build_request
    from splitserve_client.sdk_types import UPSTREAM_MS_KEY

    upstream: dict[int, float | None] = {}
    async with grpc.aio.insecure_channel(args.client) as channel:
        stub = pb_grpc.RouterStub(channel)

        async def send(index: int, prompt) -> None:
            call = stub.Generate(
                build_request(
                    prompt,
                    temperature=0.0,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    request_id=f"{args.tag}-{index}",
                ),
                timeout=60,
            )
            async for _ in call:
                pass
            ms = dict(await call.trailing_metadata() or ()).get(UPSTREAM_MS_KEY)
            upstream[index] = None if ms is None else float(ms) / 1e3

        prompts = _prompts(args.requests, args.prompt_len, args.vocab, args.seed)
        latencies = await _open_loop(send, prompts, args.rate, args.seed)
    print(json.dumps({f"{args.tag}-{i}": [s, upstream[i]] for i, s in enumerate(latencies)}))


async def _router_round(target: str, args, seed: int, tag: str, requests: int, max_tokens: int, rate: float):
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_overhead",
        "--client",
        target,
        "--tag",
        tag,
        "--seed",
        str(seed),
        "--requests",
        str(requests),
        "--rate",
        str(rate),
        "--max-tokens",
        str(max_tokens),
        "--prompt-len",
        str(args.prompt_len),
        "--vocab",
        str(args.vocab),
    ]
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), 600)
    if process.returncode != 0:
        raise RuntimeError(f"client process failed ({process.returncode})")
    return json.loads(out)


class _NullRouter(pb_grpc.RouterServicer):
    """The floor arm's server: answers every Generate with one final message, doing nothing else."""

    async def Generate(self, request, context):
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[0], finish_reason=pb.FINISH_REASON_LENGTH)


async def _null_server():
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(_NullRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def run(cluster, target: str, args) -> dict:
    client = ClusterClient(cluster)
    ids = iter(range(10**9))

    async def direct(index: int, prompt, max_tokens: int = args.max_tokens) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in client.generate(GenerateRequest(f"d{next(ids)}", tuple(prompt), params)):
            pass

    direct_s, routed, floor_s = [], {}, []  # routed: request id → [latency_s, upstream_s]
    null_server, null_target = await _null_server()
    await _open_loop(direct, _prompts(50, args.prompt_len, args.vocab, 0), args.rate, 0)  # warm-up
    await _router_round(target, args, 0, "warm", 50, args.max_tokens, args.rate)
    for round_index in range(args.rounds):  # alternate arms: machine noise hits all alike
        seed = args.seed + round_index + 1
        direct_s += await _open_loop(
            direct, _prompts(args.requests, args.prompt_len, args.vocab, seed), args.rate, seed
        )
        routed.update(
            await _router_round(target, args, seed, f"r{round_index}", args.requests, args.max_tokens, args.rate)
        )
        floor_s += [
            latency
            for latency, _ in (
                await _router_round(
                    null_target, args, seed, f"f{round_index}", args.requests, args.max_tokens, args.rate
                )
            ).values()
        ]
    await null_server.stop(1.0)
    paired = [seen_s - upstream_s for seen_s, upstream_s in routed.values()]
    per_token = await _streaming(direct, target, args)
    await client.close()
    return _report(direct_s, [seen_s for seen_s, _ in routed.values()], paired, floor_s, per_token, args)


async def _streaming(direct, target: str, args) -> dict:
    took: dict[str, list[float]] = {"direct": [], "router": []}
    for index in range(args.stream_requests):
        prompt = _prompts(1, args.prompt_len, args.vocab, 1000 + index)[0]
        started_s = time.perf_counter()
        await direct(index, prompt, args.stream_tokens)
        took["direct"].append((time.perf_counter() - started_s) / args.stream_tokens)
        seen = await _router_round(target, args, 1000 + index, f"s{index}", 1, args.stream_tokens, 1000.0)
        took["router"].append(next(iter(seen.values()))[0] / args.stream_tokens)
    return {arm: _pct(values, 0.5) for arm, values in took.items()}


def _report(direct_s, router_s, paired_s, floor_s, per_token: dict, args) -> dict:
    row = {"rate_rps": args.rate, "requests_per_arm": len(direct_s)}
    for arm, values in (("direct", direct_s), ("router", router_s), ("grpc_floor", floor_s)):
        row[f"{arm}_p50_ms"] = _pct(values, 0.50) * 1e3
        row[f"{arm}_p99_ms"] = _pct(values, 0.99) * 1e3
    row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
    row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
    row["paired_added_p50_ms"] = _pct(paired_s, 0.50) * 1e3
    row["paired_added_p99_ms"] = _pct(paired_s, 0.99) * 1e3
    row["per_token_direct_ms"] = per_token["direct"] * 1e3
    row["per_token_router_ms"] = per_token["router"] * 1e3
    row["per_token_added_ms"] = (per_token["router"] - per_token["direct"]) * 1e3
    return row


def _small_model() -> str:
    """The demo model's tokenizer and architecture, shrunk: compute stays small next to the overheads
    being measured (the full demo model saturates one prefill core well below 200 req/s)."""
    import tempfile

    from engine.demo_model import write_demo_model

    out = tempfile.mkdtemp(prefix="splitserve-bench-model-")
    write_demo_model(
        out,
        progress=False,
        config_overrides={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    )
    return out


async def bench_main(args) -> dict:
    from router.server import RouterServer

    pool = PoolConfig(num_cpus=1.0, threads=1)
    config = ClusterConfig(prefill=pool, decode=pool, router=RouterConfig(port=0, http_port=None), ray_num_cpus=4)
    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(None, launch, config, args.model or _small_model())
    try:
        server = await RouterServer.start(cluster, config)
        try:
            return await run(cluster, server.address, args)
        finally:
            await server.stop(1.0)
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a 2-layer, 64-wide demo-model variant)")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=400, help="requests per arm per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--stream-requests", type=int, default=10)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the router arm's client
    parser.add_argument("--tag", default="r", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(client_main(args))
        return
    row = asyncio.run(bench_main(args))
    print(json.dumps(row, indent=1))
    print(
        f"router overhead at {args.rate:g} req/s, paired per request: +{row['paired_added_p50_ms']:.2f} ms p50, "
        f"+{row['paired_added_p99_ms']:.2f} ms p99 (target p99 <= 2 ms); arm vs arm: "
        f"+{row['added_p50_ms']:.2f} ms p50, +{row['added_p99_ms']:.2f} ms p99; "
        f"gRPC floor (do-nothing handler): {row['grpc_floor_p50_ms']:.2f} ms p50, "
        f"{row['grpc_floor_p99_ms']:.2f} ms p99; "
        f"streaming: +{row['per_token_added_ms']:.3f} ms per token"
    )


if __name__ == "__main__":
    main()
