"""Simulator speed: simulated requests per second of wall and of CPU time, `cache_aware` scoring every
worker vs walking holder levels over a LoadBook, on the same workload in the same run.

    python -m benchmarks.bench_sim_speed --profile h100-1b.json --workload trace --trace "$TRACE" \\
        --trace-spread-s 3 --trace-prompt-scale 1 --rate 11000 --repeat 2 --prefill 1250 --decode 750 \\
        --routers 250 --ttft-ms 1000 --tpot-ms 50 [--routing indexed exhaustive] [--json FILE]

Takes every flag of `splitserve simulate`. Both runs must report the same results (the two algorithms
choose the same workers): the script says whether they do. CPU time is the process's, around the
simulation loop only (a shared machine's wall clock also counts other processes' work).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from loadtest.sim_args import load_inputs, with_pools
from loadtest.sim_cli import build_parser
from loadtest.sim_report import sim_summary
from policies.routing.cache_aware import ExhaustiveCacheAwarePolicy
from sim.simulator import Simulation


def run_once(args: argparse.Namespace, routing: str) -> tuple[dict, dict]:
    profile, requests, notes, base = load_inputs(args)
    config = with_pools(
        base, 0 if args.colocated else args.prefill, 0 if args.colocated else args.decode, args.tp, args.colocated
    )
    simulation = Simulation(config, profile)
    if routing == "exhaustive" and config.policy == "cache_aware":
        simulation.router.policy = ExhaustiveCacheAwarePolicy(simulation.router.index)
    cpu_start = time.process_time()
    result = simulation.run(requests)
    cpu_s = time.process_time() - cpu_start
    summary = sim_summary(result, profile, workload=args.workload, notes=notes, warmup_s=args.warmup_s).to_dict()
    figures = {
        "routing": routing,
        "requests": len(requests),
        "events": result.events,
        "wall_s": round(result.wall_s, 2),
        "cpu_s": round(cpu_s, 2),
        "requests_per_wall_s": round(len(requests) / result.wall_s),
        "requests_per_cpu_s": round(len(requests) / cpu_s),
    }
    return figures, summary


def main() -> None:
    parser = build_parser()
    parser.prog = "python -m benchmarks.bench_sim_speed"
    parser.add_argument("--routing", nargs="+", choices=("indexed", "exhaustive"), default=["indexed", "exhaustive"])
    args = parser.parse_args()
    rows, summaries = [], []
    for routing in args.routing:
        figures, summary = run_once(args, routing)
        rows.append(figures)
        # Everything but the run's own speed must match between the two algorithms.
        summaries.append(json.dumps(_without_speed(summary), sort_keys=True, default=str))
        print(json.dumps(figures))
    report = {
        "machine": platform.processor() or platform.machine(),
        "cluster": f"{args.prefill}P{args.decode}D",
        "same_results": len(set(summaries)) == 1,
        "rows": rows,
    }
    print(f"same results: {report['same_results']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def _without_speed(value):
    if isinstance(value, dict):
        return {k: _without_speed(v) for k, v in value.items() if "wall" not in k}
    return value


if __name__ == "__main__":
    main()
