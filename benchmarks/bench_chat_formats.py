"""What tool calling and JSON schemas cost a chat stream end to end: `splitserve bench --backend openai-chat`
with each `--chat-format` against one router's HTTP front.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_chat_formats [--requests 8] [--concurrency 4]
        [--prompt-tokens 64] [--output-tokens 64] [--rounds 2] [--json docs/perf/chat_formats/<hardware>.json]

One local Ray cluster (1 prefill worker, 1 decode instance of TP 1, a router with its HTTP front; the demo
model's shape, random weights, CPU). Each round runs the same plan (the same arrivals, prompts and
lengths: `--seed` fixed) once per format, the formats' order rotating between rounds: `plain` (free text,
`ignore_eos`, the baseline), `tools` (two function tools, `tool_choice: "required"`: the answer is held to
a tool-call grammar) and `json-schema` (`response_format` with a nested strict schema). The grammar
formats end when their grammar does, so their streams are shorter; TPOT (time per output token after the
first, per stream) compares them per token. Reported per format: TPOT p50 over every stream of every
round, its ratio to `plain`'s measured in the same run (the figure: what the grammar's per-token mask and
the output parsing cost), TTFT p50 (grammar compile on a cold cache shows here), output tokens per
stream and the share of requests that completed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import ray

from benchmarks.bench_kv_store import _Loop
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig, RouterConfig
from engine.demo_model import write_demo_model
from loadtest.chat_formats import CHAT_FORMATS
from loadtest.config import BenchConfig
from loadtest.driver import DriverConfig
from loadtest.lengths import LengthDist
from loadtest.poisson import PoissonSpec
from loadtest.records import read_jsonl
from loadtest.runner import run_bench
from router.server import RouterServer


def _run(url: str, chat_format: str, args, out: Path) -> list:
    spec = PoissonSpec(
        args.requests,
        float("inf"),
        LengthDist.parse(f"fixed:{args.prompt_tokens}"),
        LengthDist.parse(f"fixed:{args.output_tokens}"),
    )
    driver = DriverConfig(args.concurrency, None, 10.0, 900.0, 1.0, f"chat-{chat_format}", False)
    config = BenchConfig(
        url, "poisson", spec, driver, seed=7, out_dir=str(out), backend="openai-chat", chat_format=chat_format
    )
    asyncio.run(run_bench(config, echo=lambda _: None))
    return read_jsonl(out / "records.jsonl")


def _given_flags() -> list[str]:
    import sys

    return sys.argv[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--formats", default=",".join(CHAT_FORMATS), help="comma-separated, plain first")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    formats = tuple(args.formats.split(","))
    if formats[0] != "plain" or not set(formats) <= set(CHAT_FORMATS):
        parser.error(f"--formats: 'plain' (the baseline) first, then any of {', '.join(CHAT_FORMATS)}")

    workdir = Path(tempfile.mkdtemp(prefix="bench-chat-formats-"))
    model_dir = write_demo_model(workdir / "model", progress=False)
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    pool = PoolConfig(num_cpus=0.5, threads=1, num_kv_blocks=512)
    config = ClusterConfig(
        prefill=pool,
        decode=replace(pool),
        ready_timeout_s=600.0,
        request_timeout_s=900.0,
        router=RouterConfig(port=0, http_port=0),
    )
    cluster = launch(config, str(model_dir))
    loop = _Loop()
    server = loop.call(RouterServer.start(cluster, config))
    records: dict[str, list] = {name: [] for name in formats}
    try:
        url = server.http.url
        for r in range(-1, args.rounds):  # round -1 warms the cluster and the grammar cache: not measured
            order = formats[r % len(formats) :] + formats[: r % len(formats)]
            for name in order:
                got = _run(url, name, args, workdir / f"round{r}-{name}")
                if r >= 0:
                    records[name].extend(got)
    finally:
        loop.call(server.stop(grace_s=1.0))
        loop.close()
        cluster.shutdown()

    rows = {}
    for name in formats:
        done = [rec for rec in records[name] if rec.ok]
        tpots = [rec.tpot_s * 1e3 for rec in done if rec.tpot_s is not None]
        rows[name] = {
            "tpot_p50_ms": statistics.median(tpots) if tpots else None,
            "ttft_p50_ms": statistics.median([rec.ttft_s * 1e3 for rec in done if rec.ttft_s is not None] or [0.0]),
            "output_tokens_mean": statistics.fmean([rec.output_tokens for rec in done] or [0.0]),
            "completed": f"{len(done)}/{len(records[name])}",
            "streams_timed": len(tpots),
            "errors": sorted({f"{rec.error_code}: {rec.error_reason}" for rec in records[name] if not rec.ok}),
        }
    base = rows["plain"]["tpot_p50_ms"]
    for row in rows.values():
        row["tpot_vs_plain"] = row["tpot_p50_ms"] / base if base and row["tpot_p50_ms"] else None
    for name, row in rows.items():
        print(f"{name:12s} {json.dumps(row)}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "chat_formats",
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "formats")},
            "command": "python -m benchmarks.bench_chat_formats " + " ".join(_given_flags()),
            "formats": rows,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
