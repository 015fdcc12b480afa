"""`splitserve plan`: the prefill / decode counts and TP with the highest goodput per worker at an SLO.

    splitserve plan --profile cpu.json --workload poisson --rate 2 --num-requests 400 \\
        --ttft-ms 1000 --tpot-ms 100 --max-workers 6
    splitserve plan --profile h100-1b.json --workload trace --trace conversation_trace.jsonl \\
        --ttft-ms 1000 --tpot-ms 50 --max-workers 8 --tp 1,2 --fleet-rate 1000

Every shape within --max-workers (P prefill workers + D decode instances x TP ranks, and colocated
workers as the baseline) gets the highest request rate at which --attainment of the requests meet
the SLO (the workload's arrivals scaled in time; sim/search.py); the table ranks them by
that rate per worker (DistServe's per-GPU goodput) and the first row is the choice. --fleet-rate R
then sizes a fleet for R req/s from copies of the chosen shape and simulates the whole fleet at R
(the workload tiled in time until it spans --fleet-duration-s) to check it. A roofline profile's
figures are estimates: the header says which profile the table comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from loadtest.sim_args import add_sim_flags, load_inputs, with_pools
from loadtest.sim_workload import repeat_trace
from sim.search import PlanRow, base_rate, rescaled, search
from sim.simulator import simulate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve plan",
        description="Size the prefill and decode pools for a workload at an SLO, by simulation.",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_sim_flags(parser)
    g = parser.add_argument_group("search")
    g.add_argument("--max-workers", type=int, default=8, help="accelerators (or cores) at most (default 8)")
    g.add_argument("--tp", default="1", help="decode / colocated TP sizes to try, e.g. 1,2 (default 1)")
    g.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting the SLO (default 0.9)")
    g.add_argument(
        "--search-requests",
        type=int,
        default=2000,
        help="requests of the workload each search simulation runs, from its start (default 2000)",
    )
    g.add_argument("--fleet-rate", type=float, help="size and simulate a fleet for this many req/s")
    g.add_argument("--fleet-duration-s", type=float, default=3600.0, help="with --fleet-rate (default 3600)")
    parser.add_argument("--json", metavar="FILE", help="write the table and the choice here")
    return parser


def _check(args) -> tuple[int, ...]:
    if args.max_workers < 2:
        raise ValueError("--max-workers must be >= 2")
    if not 0 < args.attainment <= 1:
        raise ValueError("--attainment must be in (0, 1]")
    if args.ttft_ms is None and args.tpot_ms is None:
        raise ValueError("plan needs an SLO: --ttft-ms and/or --tpot-ms")
    try:
        tp_sizes = tuple(int(v) for v in args.tp.split(","))
    except ValueError:
        raise ValueError(f"--tp must be comma-separated whole numbers, got {args.tp!r}") from None
    return tp_sizes


def format_table(rows: list[PlanRow], label: str, attainment: float) -> str:
    lines = [
        f"profile: {label}",
        f"max rate meeting the SLO for {attainment:.0%} of requests, per worker:",
        f"{'':2}{'shape':<12} {'workers':>7} {'max req/s':>10} {'req/s/worker':>13}",
    ]
    for i, row in enumerate(rows):
        mark = "->" if i == 0 else "  "
        lines.append(
            f"{mark}{row.name:<12} {row.config.workers:>7} {row.max_rate_per_s:>10.3f} {row.per_worker:>13.4f}"
        )
    colocated = [r for r in rows if r.config.colocated]
    disagg = [r for r in rows if not r.config.colocated]
    if colocated and disagg and colocated[0].per_worker > 0:
        lines.append(
            f"best disaggregated {disagg[0].name}: {disagg[0].per_worker / colocated[0].per_worker:.2f}x "
            f"the per-worker goodput of the best colocated {colocated[0].name}"
        )
    return "\n".join(lines)


def workload_line(notes: dict, max_model_len: int) -> str | None:
    """A warning when the table covers less than the workload: rows that did not fit the profile's
    model (max_model_len) were dropped or clipped, so the traffic planned for is lighter than asked."""
    dropped, clipped = notes.get("rows_dropped") or {}, notes.get("rows_clipped") or notes.get("requests_clipped")
    if not dropped and not clipped:
        return None
    of = f" of {notes['rows_read']:,} rows" if "rows_read" in notes else ""
    parts = [f"dropped {n:,}{of} ({why})" for why, n in dropped.items()] + ([f"clipped {clipped:,}"] if clipped else [])
    return (
        f"workload: {'; '.join(parts)}; the profile's model takes {max_model_len:,} tokens, so the plan is for "
        "the traffic that fits, not all of it"
    )


def fleet(best: PlanRow, profile, requests, rate: float, duration_s: float):
    """(config, result, simulated requests/s): copies of `best` for `rate`, run over `duration_s`. Each
    copy brings the routers the plan assumed for one (their concurrency limit would otherwise refuse
    a fleet's traffic as if one router served it)."""
    copies = max(1, math.ceil(rate / best.max_rate_per_s)) if best.max_rate_per_s > 0 else 1
    c = best.config
    config = with_pools(c, c.prefill * copies, c.decode * copies, c.tp, c.colocated * copies)
    config = dataclasses.replace(config, routers=c.routers * copies)
    scaled = rescaled(requests, rate / base_rate(requests))
    span_s = scaled[-1].arrival_s - scaled[0].arrival_s
    tiled = repeat_trace(scaled, max(1, math.ceil(duration_s / max(span_s, 1e-9))))
    started = time.perf_counter()
    result = simulate(config, profile, tiled)
    return config, result, len(tiled) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tp_sizes = _check(args)
        profile, requests, notes, base = load_inputs(args)
    except ValueError as err:
        parser.error(str(err))
    sample = requests[: args.search_requests]
    started = time.perf_counter()
    rows = search(profile, sample, base, args.max_workers, args.attainment, tp_sizes)
    runs = sum(r.simulations for r in rows)
    print(format_table(rows, profile.label, args.attainment))
    warning = workload_line(notes, profile.model.max_model_len)
    if warning:
        print(warning)
    print(f"\n{runs} simulations of {len(sample)} requests in {time.perf_counter() - started:.1f} s")
    report = {
        "profile": profile.label,
        "attainment": args.attainment,
        "notes": notes,
        "rows": [
            {
                "shape": r.name,
                "workers": r.config.workers,
                "max_rate_per_s": r.max_rate_per_s,
                "per_worker": r.per_worker,
            }
            for r in rows
        ],
        "choice": rows[0].name,
    }
    if args.fleet_rate:
        config, result, speed = fleet(rows[0], profile, requests, args.fleet_rate, args.fleet_duration_s)
        s = result.summary()
        print(
            f"fleet for {args.fleet_rate:g} req/s: {config.name} ({config.workers} workers, {config.routers} "
            f"router(s) of {config.router_max_requests} requests): attainment "
            f"{s.slo_attainment:.1%}, goodput {s.goodput_per_s:.1f} req/s over {s.duration_s:.0f} s; "
            f"{len(result.records)} requests simulated at {speed:,.0f} simulated requests/s"
        )
        report["fleet"] = {
            "shape": config.name,
            "workers": config.workers,
            "routers": config.routers,
            "rejected": sum(r.status == "rejected" for r in result.records),
            "attainment": s.slo_attainment,
            "goodput_per_s": s.goodput_per_s,
            "requests": len(result.records),
            "simulated_requests_per_s": speed,
        }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
