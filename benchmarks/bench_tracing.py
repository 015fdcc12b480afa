"""What tracing costs: router CPU per request and time per output token with 16 concurrent streams, tracing
off vs on (every request sampled, spans exported over OTLP/gRPC to a receiver on loopback).

`scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_tracing --json docs/perf/tracing_cost/cpu.json`
launches 1 prefill + 1 decode actor over a shrunken demo model (unless `--model`) and serves a router on this
process's event loop, once per arm and round, arms alternating (off, on, off, on, ...): tracing is set when a
cluster starts (its workers read `otlp_traces_endpoint`). A client process sends `--requests` streaming
requests, `--streams` at a time, over gRPC. Figures per arm, over its rounds:
  router_cpu_ms_per_request: this process's CPU time during the round (the router, its Ray driver threads
    and the span exporter) divided by the requests;
  tpot_p50_ms / tpot_p99_ms: per request, (last token - first token) / (tokens - 1), as the client saw it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc

from cluster.launcher import launch
from common import tracing
from common.config import ClusterConfig, PoolConfig, RouterConfig


class _SpanSink:
    """An OTLP/gRPC trace receiver that counts what it gets (a collector's side of the protocol)."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self
        self.spans = 0

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


async def client_main(args) -> None:
    """The client process: `--requests` streams, `--streams` at a time; prints each request's TPOT (s)."""
    from splitserve_client.client import build_request
    from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc

    tpots: list[float] = []
    async with grpc.aio.insecure_channel(args.client) as channel:
        stub = pb_grpc.RouterStub(channel)
        gate = asyncio.Semaphore(args.streams)

        async def one(index: int) -> None:
            async with gate:
                prompt = [10 + (index * 7 + i) % 3000 for i in range(args.prompt_len)]
                request = build_request(
                    prompt, temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, request_id=f"t{index}"
                )
                times, count = [], 0
                async for response in stub.Generate(request, timeout=300):
                    count += len(response.token_ids)
                    times.append(time.perf_counter())
                if count > 1:
                    tpots.append((times[-1] - times[0]) / (count - 1))

        await asyncio.gather(*(one(i) for i in range(args.requests)))
    print(json.dumps(tpots))


async def _round(config: ClusterConfig, model: str, args) -> tuple[float, list[float]]:
    from router.server import RouterServer

    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(None, launch, config, model)
    try:
        server = await RouterServer.start(cluster, config)
        try:
            await _client(server.address, args, max(args.streams, 8))  # warm-up
            cpu_s = time.process_time()
            tpots = await _client(server.address, args, args.requests)
            cpu_s = time.process_time() - cpu_s
        finally:
            await server.stop(1.0)
    finally:
        cluster.shutdown()
        tracing.shutdown()
    return cpu_s / args.requests, tpots


async def _client(target: str, args, requests: int) -> list[float]:
    command = [sys.executable, "-m", "benchmarks.bench_tracing", "--client", target, "--requests", str(requests)]
    command += [
        "--streams",
        str(args.streams),
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-len",
        str(args.prompt_len),
    ]
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), 900)
    if process.returncode != 0:
        raise RuntimeError(f"client process failed ({process.returncode})")
    return json.loads(out)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_main(args) -> dict:
    from benchmarks.bench_overhead import _small_model

    model = args.model or _small_model()
    sink = _SpanSink()
    pool = PoolConfig(num_cpus=1.0, threads=1)
    base = ClusterConfig(prefill=pool, decode=pool, router=RouterConfig(port=0, http_port=None), ray_num_cpus=4)
    arms = {"off": base, "on": replace(base, otlp_traces_endpoint=f"http://127.0.0.1:{sink.port}")}
    figures: dict[str, dict[str, list[float]]] = {arm: {"cpu": [], "tpot": []} for arm in arms}
    for _ in range(args.rounds):
        for arm, config in arms.items():
            cpu_per_request_s, tpots = await _round(config, model, args)
            figures[arm]["cpu"].append(cpu_per_request_s)
            figures[arm]["tpot"] += tpots
    sink.server.stop(1)
    row: dict = {
        "machine": _cpu_model(),
        "cpus": os.cpu_count(),
        "streams": args.streams,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "spans_received": sink.spans,
    }
    for arm, got in figures.items():
        row[f"{arm}_router_cpu_ms_per_request"] = sum(got["cpu"]) / len(got["cpu"]) * 1e3
        row[f"{arm}_tpot_p50_ms"] = _pct(got["tpot"], 0.5) * 1e3
        row[f"{arm}_tpot_p99_ms"] = _pct(got["tpot"], 0.99) * 1e3
    row["added_router_cpu_ms_per_request"] = row["on_router_cpu_ms_per_request"] - row["off_router_cpu_ms_per_request"]
    row["added_tpot_p50_ms"] = row["on_tpot_p50_ms"] - row["off_tpot_p50_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a 2-layer, 64-wide demo-model variant)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=160, help="requests per arm per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the client process
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(client_main(args))
        return
    row = asyncio.run(bench_main(args))
    print(json.dumps(row, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
