"""`splitserve simulate`: one simulated run of a bench workload on a stated cluster, reported as
`splitserve bench` reports a real one.

    splitserve simulate --profile cpu.json --prefill 2 --decode 1 --workload poisson --rate 3 \\
        --num-requests 200 --ttft-ms 2000 --tpot-ms 200
    splitserve simulate --profile h100-1b.json --prefill 6 --decode 3 --workload trace \\
        --trace conversation_trace.jsonl --trace-prompt-scale 1 --ttft-ms 1000 --tpot-ms 50

Exit status: 0 after a run, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadtest.sim_args import add_sim_flags, load_inputs, with_pools
from loadtest.sim_report import sim_summary
from loadtest.summary import format_table
from sim.simulator import simulate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve simulate",
        description="Simulate a bench workload on a cluster of the given shape, from a hardware profile.",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_sim_flags(parser)
    pools = parser.add_argument_group("pools")
    pools.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    pools.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    pools.add_argument("--tp", type=int, default=1, help="ranks per decode (or colocated) instance (default 1)")
    pools.add_argument("--colocated", type=int, default=0, help="colocated workers instead of prefill + decode")
    parser.add_argument("--warmup-s", type=float, default=0.0, help="requests due before this are not measured")
    parser.add_argument("--json", metavar="FILE", help="write the summary (bench's summary.json layout) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        profile, requests, notes, base = load_inputs(args)
        config = with_pools(
            base, 0 if args.colocated else args.prefill, 0 if args.colocated else args.decode, args.tp, args.colocated
        )
    except ValueError as err:
        parser.error(str(err))
    result = simulate(config, profile, requests)
    summary = sim_summary(result, profile, workload=args.workload, notes=notes, warmup_s=args.warmup_s)
    print(format_table(summary))
    print(
        f"\nsimulated {len(requests)} requests ({result.events} events) in {result.wall_s:.2f} s: "
        f"{len(requests) / max(result.wall_s, 1e-9):,.0f} simulated requests/s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({**summary.to_dict(), "profile": profile.label, "cluster": config.name}, indent=2) + "\n"
        )
