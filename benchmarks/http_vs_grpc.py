"""What the OpenAI HTTP front costs next to gRPC: the same router, the same run, `splitserve bench` with
each backend at the same rate.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.http_vs_grpc [--rounds 3]

Launches 1 prefill + 1 decode actor over a 2-layer, 64-wide variant of the demo model (so the cluster
keeps up and the fronts' costs show) and one router serving gRPC and HTTP on this process's loop, as
`splitserve serve` does. Then, alternating backends round by round (grpc, openai, openai, grpc, ...)
so that machine noise hits both alike, `splitserve bench` runs in a client process of its own:
  per request — Poisson at `--request-rate`, 8-token prompts, 1 output token: TTFT and end-to-end
                latency percentiles are the request's whole path (parse, route, prefill, respond);
  per token   — Poisson at `--stream-rate`, 64 output tokens: mean TPOT (time per output token after
                the first) and ITL percentiles.
Prints each backend's figures over all its rounds and HTTP minus gRPC, with the CPU time this process
(the router, and the cluster client it drives: the same work for both) spent per request and per
streamed token while each backend's runs went on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_overhead import _small_model
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig, RouterConfig
from loadtest.records import read_jsonl
from loadtest.stats import percentile


async def _bench(backend: str, target: str, flags: list[str], out: Path, seed: int) -> list:
    command = [
        sys.executable,
        "-c",
        "from loadtest.cli import main; main()",
        "--backend",
        backend,
        "--target",
        target,
        "--seed",
        str(seed),
        "--no-progress",
        "--out",
        str(out),
        *flags,
    ]
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.DEVNULL)
    if await asyncio.wait_for(process.wait(), 900) != 0:
        raise RuntimeError(f"splitserve bench failed: {' '.join(command)}")
    return read_jsonl(out / "records.jsonl")


async def _measure(targets: dict, args, scratch: Path) -> tuple[dict, dict]:
    workloads = {
        "request": [
            "--rate",
            str(args.request_rate),
            "--num-requests",
            str(args.requests),
            "--prompt-len",
            "fixed:8",
            "--output-len",
            "fixed:1",
            "--max-concurrency",
            "256",
        ],
        "stream": [
            "--rate",
            str(args.stream_rate),
            "--num-requests",
            str(args.streams),
            "--prompt-len",
            "fixed:8",
            "--output-len",
            f"fixed:{args.stream_tokens}",
            "--max-concurrency",
            "256",
        ],
    }
    records: dict[tuple[str, str], list] = {(w, b): [] for w in workloads for b in targets}
    cpu_s = dict.fromkeys(records, 0.0)
    for name, flags in workloads.items():  # warm-up, not measured
        for backend, target in targets.items():
            await _bench(backend, target, [*flags[:2], "--num-requests", "20", *flags[4:]], scratch / f"warm-{name}", 0)
    for round_index in range(args.rounds):
        order = list(targets) if round_index % 2 == 0 else list(reversed(targets))
        for name, flags in workloads.items():
            for backend in order:
                out = scratch / f"{name}-{backend}-{round_index}"
                started_cpu_s = time.process_time()
                records[name, backend] += await _bench(backend, targets[backend], flags, out, round_index + 1)
                cpu_s[name, backend] += time.process_time() - started_cpu_s
    return records, cpu_s


def _figures(records: dict, cpu_s: dict) -> dict:
    table = {}
    for (workload, backend), rows in records.items():
        done = [r for r in rows if r.ok]
        failed = len(rows) - len(done)
        router_cpu_ms = cpu_s[workload, backend] * 1e3
        if workload == "request":
            ttft = [r.ttft_s * 1e3 for r in done]
            e2e = [r.e2e_s * 1e3 for r in done]
            table[f"{backend}_request"] = {
                "n": len(done),
                "failed": failed,
                "ttft_p50_ms": percentile(ttft, 50),
                "ttft_p99_ms": percentile(ttft, 99),
                "e2e_p50_ms": percentile(e2e, 50),
                "e2e_p99_ms": percentile(e2e, 99),
                "router_cpu_per_request_ms": router_cpu_ms / len(rows),
            }
        else:
            tpot = [r.tpot_s * 1e3 for r in done]
            itl = [x * 1e3 for r in done for x in r.itl_s]
            tokens = sum(r.output_tokens for r in rows)
            table[f"{backend}_stream"] = {
                "n": len(done),
                "failed": failed,
                "tpot_mean_ms": sum(tpot) / len(tpot),
                "itl_p50_ms": percentile(itl, 50),
                "itl_p99_ms": percentile(itl, 99),
                "ttft_p50_ms": percentile([r.ttft_s * 1e3 for r in done], 50),
                "router_cpu_per_token_ms": router_cpu_ms / tokens,
            }
    for kind in ("request", "stream"):
        grpc, http = table[f"splitserve_{kind}"], table[f"openai_{kind}"]
        table[f"http_minus_grpc_{kind}"] = {k: http[k] - grpc[k] for k in grpc if k.endswith("_ms")}
    return table


async def main_async(args) -> dict:
    from router.server import RouterServer

    pool = PoolConfig(num_cpus=1.0, threads=1)
    config = ClusterConfig(prefill=pool, decode=pool, router=RouterConfig(port=0, http_port=0), ray_num_cpus=4)
    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(None, launch, config, args.model or _small_model())
    try:
        server = await RouterServer.start(cluster, config)
        try:
            targets = {"splitserve": server.address, "openai": server.http.url}
            with tempfile.TemporaryDirectory(prefix="http-vs-grpc-") as scratch:
                return _figures(*await _measure(targets, args, Path(scratch)))
        finally:
            await server.stop(1.0)
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a 2-layer, 64-wide demo-model variant)")
    parser.add_argument("--request-rate", type=float, default=100.0)
    parser.add_argument("--requests", type=int, default=400, help="per backend per round")
    parser.add_argument("--stream-rate", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=48, help="per backend per round")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table = asyncio.run(main_async(args))
    print(json.dumps(table, indent=1))
    request, stream = table["http_minus_grpc_request"], table["http_minus_grpc_stream"]
    print(
        f"HTTP minus gRPC at {args.request_rate:g} req/s, 1 token: TTFT p50 {request['ttft_p50_ms']:+.2f} ms, "
        f"p99 {request['ttft_p99_ms']:+.2f} ms; at {args.stream_rate:g} req/s x {args.stream_tokens} tokens: "
        f"TPOT {stream['tpot_mean_ms']:+.3f} ms, ITL p50 {stream['itl_p50_ms']:+.3f} ms; router CPU "
        f"{request['router_cpu_per_request_ms']:+.3f} ms per request, {stream['router_cpu_per_token_ms']:+.4f} ms "
        "per token"
    )


if __name__ == "__main__":
    main()
