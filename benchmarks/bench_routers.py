"""Two routers against one: the request rate at which router-side p99 overhead doubles.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_routers [--rates 25,50,100,200,300,400]

One cluster (1 prefill + 1 decode, the shrunken demo model of `bench_overhead`), started by this
process, and two `splitserve router` processes joined to it (real processes, as on a fleet). At each
total rate R, open-loop Poisson, `--max-tokens 1`, two arms run in turn:
  one router   one client process sends R to router A;
  two routers  two client processes send R/2 each, to router A and to router B, at the same time.
Router-side overhead is paired per request: the latency its client saw minus the time its router
spent waiting on the cluster for it (the router's `splitserve-upstream-ms` trailer). An arm's doubling
rate is the lowest R whose p99 overhead is at least twice the arm's p99 at the lowest rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time

import ray

from benchmarks.bench_overhead import _pct, _router_round, _small_model
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig

CLUSTER = "routers-bench"


def _start_router(gcs_address: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "router",
            "--ray-address",
            gcs_address,
            "--cluster-name",
            CLUSTER,
            "--port",
            "0",
            "--http-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline_s = time.monotonic() + 120
    assert process.stdout is not None, "stdout=PIPE"
    for line in process.stdout:
        match = re.search(r"router listening on (\S+)", line)
        if match:
            return process, match.group(1)
        if time.monotonic() > deadline_s:
            break
    process.kill()
    raise RuntimeError("a router process did not start")


async def _arms(targets: list[str], rate: float, args) -> dict:
    seed = int(rate * 1000)
    one = await _router_round(targets[0], args, seed, f"one{seed}", args.requests, 1, rate)
    halves = await asyncio.gather(
        *(
            _router_round(t, args, seed + k, f"two{k}-{seed}", args.requests // 2, 1, rate / 2)
            for k, t in enumerate(targets)
        )
    )
    two = {rid: pair for half in halves for rid, pair in half.items()}
    row = {"rate_rps": rate}
    for arm, pairs in (("one", one), ("two", two)):
        latencies = [latency for latency, _ in pairs.values()]
        overheads = [latency - upstream for latency, upstream in pairs.values()]
        row[f"{arm}_p99_ms"] = _pct(latencies, 0.99) * 1e3
        row[f"{arm}_overhead_p50_ms"] = _pct(overheads, 0.50) * 1e3
        row[f"{arm}_overhead_p99_ms"] = _pct(overheads, 0.99) * 1e3
    return row


def _doubling_rate(rows: list[dict], arm: str) -> float | None:
    base = rows[0][f"{arm}_overhead_p99_ms"]
    return next((r["rate_rps"] for r in rows[1:] if r[f"{arm}_overhead_p99_ms"] >= 2 * base), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="25,50,100,200,300,400", help="total request rates, req/s")
    parser.add_argument("--requests", type=int, default=400, help="requests per arm and rate")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    pool = PoolConfig(num_cpus=1.0, threads=1)
    launched = launch(ClusterConfig(cluster_name=CLUSTER, prefill=pool, decode=pool, ray_num_cpus=4), _small_model())
    routers = []
    try:
        routers = [_start_router(ray.get_runtime_context().gcs_address) for _ in range(2)]
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            rows.append(asyncio.run(_arms([t for _, t in routers], rate, args)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for process, _ in routers:
            process.kill()
            process.wait(30)
        launched.shutdown()
    print(f"{'rate':>6} {'1 router: overhead p50 / p99':>30} {'2 routers: overhead p50 / p99':>31}  (ms)")
    for r in rows:
        print(
            f"{r['rate_rps']:>6g} {r['one_overhead_p50_ms']:>20.2f} / {r['one_overhead_p99_ms']:<8.2f}"
            f"{r['two_overhead_p50_ms']:>21.2f} / {r['two_overhead_p99_ms']:<8.2f}"
        )
    print(
        f"p99 overhead doubles at: one router {_doubling_rate(rows, 'one')} req/s, "
        f"two routers {_doubling_rate(rows, 'two')} req/s (None: not within the rates run)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
