"""Chaos on 2 prefill + 2 decode: a worker SIGKILLed every 10 s for 2 minutes under a trace replay.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_chaos [--every-s 10] [--duration-s 120] \\
        [--json docs/perf/chaos/cpu.json] [-- extra splitserve chaos / bench flags]

Launches the cluster (a shrunken demo model, so that 2 cores keep up with the replay), serves a router
on this process's loop as `splitserve serve` does, then runs `splitserve chaos` (loadtest/chaos.py):
the Mooncake conversation trace replayed once fault-free and once under kills, compared request by
request. Defaults: the 300-row slice shipped in tests/data/traces (or --trace), its 3 s buckets spread,
prompts at one KV block per trace block, outputs scaled down to keep the replay within a small host's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig, RouterConfig
from loadtest.chaos import format_report, parse_chaos, run_chaos

SLICE = Path(__file__).resolve().parents[1] / "tests/data/traces/mooncake-fast25/conversation_trace.jsonl"


def _model() -> str:
    from engine.demo_model import write_demo_model

    out = tempfile.mkdtemp(prefix="splitserve-chaos-model-")
    write_demo_model(
        out,
        progress=False,
        config_overrides={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    )
    return out


async def _serve_and_chaos(launched, chaos_argv: list[str]):
    from router.server import RouterServer

    server = await RouterServer.start(launched, launched.config)
    try:
        config = parse_chaos(["--target", server.address, *chaos_argv])
        return await run_chaos(config, launched.controller)
    finally:
        await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(SLICE), help="Mooncake JSON Lines trace (default: the slice)")
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=1.5, help="mean request rate the trace is rescaled to")
    parser.add_argument("--json", help="write the chaos report here")
    args, extra = parser.parse_known_args(argv)
    pool = PoolConfig(num_cpus=0.5, threads=1, num_kv_blocks=2048)
    config = ClusterConfig(
        prefill=replace_replicas(pool, 2),
        decode=replace_replicas(pool, 2),
        router=RouterConfig(port=0),
        ray_num_cpus=4,
        ready_timeout_s=300.0,
    )
    chaos_argv = [
        "--workload",
        "trace",
        "--trace",
        args.trace,
        "--rate",
        str(args.rate),
        "--trace-spread-s",
        "3",
        "--trace-output-scale",
        "0.1",
        "--duration-s",
        str(args.duration_s),
        "--grace-s",
        "120",
        "--kill",
        "any",
        "--every-s",
        str(args.every_s),
        "--max-concurrency",
        "256",
        "--no-progress",
        *(extra[1:] if extra[:1] == ["--"] else extra),
    ]
    launched = launch(config, _model())
    try:
        report = asyncio.run(_serve_and_chaos(launched, chaos_argv))
    finally:
        launched.shutdown()
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def replace_replicas(pool: PoolConfig, replicas: int) -> PoolConfig:
    from dataclasses import replace

    return replace(pool, replicas=replicas)


if __name__ == "__main__":
    main()
