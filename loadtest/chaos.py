"""`splitserve chaos`: SIGKILL workers while a `splitserve bench` workload runs, and report what clients saw.

    splitserve chaos --target 127.0.0.1:50051 --ray-address 127.0.0.1:6379 --kill any --every-s 10 \\
        --duration-s 120 --workload poisson --rate 2 --num-requests 400 [--json chaos.json]

1. Replay the workload once with no kill (the fault-free reference; greedy, EOS ignored), unless
   `--reference records.jsonl` gives one from an earlier run.
2. Replay it again while, every `--every-s` before `--duration-s` (not while the replay drains), the
   controller SIGKILLs one serving worker of the chosen role (`prefill`, `decode` or `any`; the
   worker's own process, no polite stop), and time how long the pools take to be back to full strength
   (every slot serving, the victim's with a new epoch).
3. Report, per request of the chaos run against the same request of the reference: lost (no end:
   still open when the run stopped, or a stream closed without a finish), failed by status, hung (its
   deadline passed), duplicated or missing tokens (more or fewer than asked), diverged (other tokens),
   migrations per request, and the recovery time of each kill. Exit status 0 only when nothing was
   lost, failed, hung, duplicated, missing or diverged.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

from loadtest.backends import GrpcBackend
from loadtest.chaos_killer import Killer
from loadtest.cli import build_parser, config_from_args
from loadtest.config import BenchConfig, read_token
from loadtest.driver import drive
from loadtest.records import RequestRecord, read_jsonl
from loadtest.runner import BenchError, _limits, _plan

ROLES = ("prefill", "decode", "any")


@dataclass(frozen=True)
class ChaosConfig:
    bench: BenchConfig
    ray_address: str | None
    cluster_name: str
    kill: str
    every_s: float
    reference: str | None = None
    json_out: str | None = None


@dataclass
class ChaosReport:
    requests: int
    completed: int
    lost: int
    failed_by_status: dict[str, int]
    hung: int
    duplicated: int
    missing: int
    diverged: int
    compared: int  # requests that completed in both runs and were compared token by token
    migrations_per_request: dict[int, int]
    kills: list[dict]
    # Per migrated request: its longest wait between tokens (the migration's stall, TTFT included), the
    # tokens it had to prefill again there (prompt + tokens streamed before), and its end-to-end time
    # over the same request's in the fault-free replay.
    stalls: list[dict] = dataclasses.field(default_factory=list)
    extra_e2e_unmigrated_s: float | None = None  # the same, median over requests that did not migrate

    @property
    def clean(self) -> bool:
        return not (self.lost or self.failed_by_status or self.hung or self.duplicated or self.missing or self.diverged)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "clean": self.clean}


def compare(chaos: list[RequestRecord], reference: list[RequestRecord], kills: list[dict]) -> ChaosReport:
    """The report of a chaos run against its fault-free reference (matched by plan index)."""
    ref = {r.index: r for r in reference if r.ok}
    failed = Counter(
        r.error_code for r in chaos if r.error_code not in (None, "CANCELLED", "DEADLINE_EXCEEDED") and not _lost(r)
    )
    compared = [r for r in chaos if r.ok and r.index in ref]
    return ChaosReport(
        requests=len(chaos),
        completed=sum(r.ok for r in chaos),
        lost=sum(_lost(r) for r in chaos),
        failed_by_status=dict(failed),
        hung=sum(r.error_code == "DEADLINE_EXCEEDED" for r in chaos),
        duplicated=sum(r.ok and len(r.token_ids) > r.max_tokens for r in chaos),
        missing=sum(r.ok and r.finish_reason == "length" and len(r.token_ids) < r.max_tokens for r in chaos),
        diverged=sum(r.token_ids != ref[r.index].token_ids for r in compared),
        compared=len(compared),
        migrations_per_request=dict(sorted(Counter(r.migrations for r in chaos if r.ok).items())),
        kills=kills,
        stalls=[_stall(r, ref[r.index]) for r in compared if r.migrations],
        extra_e2e_unmigrated_s=_median([r.e2e_s - ref[r.index].e2e_s for r in compared if not r.migrations]),
    )


def _stall(record: RequestRecord, reference: RequestRecord) -> dict:
    times = (0.0, *record.token_times_s)
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    at = max(range(len(gaps)), key=gaps.__getitem__)
    return {
        "index": record.index,
        "migrations": record.migrations,
        "stall_s": round(gaps[at], 4),
        "context_tokens": record.prompt_tokens + at,
        "extra_e2e_s": round(record.e2e_s - reference.e2e_s, 4),
    }


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def _lost(record: RequestRecord) -> bool:
    return record.error_code == "CANCELLED" or (
        record.error_code == "CLIENT_ERROR" and "without a finish reason" in (record.error_reason or "")
    )


async def run_chaos(config: ChaosConfig, controller, echo=print) -> ChaosReport:
    """Runs the reference (unless given) and the chaos replay; `controller` is the cluster's actor."""
    bench = config.bench
    async with GrpcBackend(
        bench.target, read_token(bench.auth_token_file), bench.driver.request_timeout_s, tls=bench.tls
    ) as client:
        plan = _plan(bench, await _limits(client), None, 0)
        if config.reference is not None:
            reference = read_jsonl(config.reference)
        else:
            echo(f"reference: {len(plan.requests)} requests planned, no kills")
            run = await drive(client, plan, dataclasses.replace(bench.driver, run_tag=_tag("ref")))
            reference = list(run.records)
        pool = "any pool" if config.kill == "any" else f"the {config.kill} pool"
        echo(f"chaos: the same requests, one worker of {pool} SIGKILLed every {config.every_s:g} s")
        killer = Killer(controller, config.kill, config.every_s, random.Random(bench.seed), echo)
        killing = asyncio.ensure_future(killer.run(bench.driver.duration_s))
        try:
            result = await drive(client, plan, dataclasses.replace(bench.driver, run_tag=_tag("chaos")))
        finally:
            killing.cancel()
        kills = await killer.settle(timeout_s=120.0)
    return compare(list(result.records), list(reference), kills)


def _tag(kind: str) -> str:
    return f"{kind}-{int(time.time() * 1000) % 10**9}"


def format_report(report: ChaosReport) -> str:
    recoveries = [k["recovered_s"] for k in report.kills if k.get("recovered_s") is not None]
    replaced = [k["replaced_s"] for k in report.kills if k.get("replaced_s") is not None]
    lines = [
        (f"requests {report.requests}, completed {report.completed}, compared with the reference {report.compared}"),
        (
            f"lost {report.lost}, hung {report.hung}, duplicated {report.duplicated}, missing {report.missing}, "
            f"diverged {report.diverged}, failed by status {report.failed_by_status or 'none'}"
        ),
        f"migrations per request {report.migrations_per_request}",
        f"kills {len(report.kills)}; the victim's replacement serving after "
        + (f"{min(replaced):.1f}-{max(replaced):.1f} s" if replaced else "(none)")
        + "; every pool at full strength again after "
        + (f"{min(recoveries):.1f}-{max(recoveries):.1f} s" if recoveries else "(none recovered)")
        + f" ({sum(k.get('recovered_s') is None for k in report.kills)} not recovered)",
        _stall_line(report),
        "CLEAN" if report.clean else "NOT CLEAN",
    ]
    return "\n".join(lines)


def _stall_line(report: ChaosReport) -> str:
    if not report.stalls:
        return "no request migrated"
    stalls = sorted(s["stall_s"] for s in report.stalls)
    extra = sorted(s["extra_e2e_s"] for s in report.stalls)
    unmigrated = report.extra_e2e_unmigrated_s
    return (
        f"migrated requests {len(stalls)}: stall p50 {stalls[len(stalls) // 2] * 1e3:.0f} ms, max "
        f"{stalls[-1] * 1e3:.0f} ms; end-to-end over the fault-free run p50 {extra[len(extra) // 2] * 1e3:+.0f} ms"
        + (f" (requests that did not migrate: {unmigrated * 1e3:+.0f} ms)" if unmigrated is not None else "")
    )


def build_chaos_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog, parser.description = "splitserve chaos", __doc__.split("\n\n")[0]
    chaos = parser.add_argument_group("chaos")
    chaos.add_argument("--ray-address", help="the cluster's Ray address (default: this process's Ray)")
    chaos.add_argument("--cluster-name", default="default", help="default %(default)s")
    chaos.add_argument("--kill", choices=ROLES, default="any", help="which pool to kill in (default any)")
    chaos.add_argument("--every-s", type=float, default=10.0, help="seconds between kills (default 10)")
    chaos.add_argument("--reference", metavar="RECORDS", help="a fault-free run's records.jsonl (skips the replay)")
    chaos.add_argument("--json", metavar="FILE", help="write the report here")
    return parser


def parse_chaos(argv: list[str]) -> ChaosConfig:
    parser = build_chaos_parser()
    args = parser.parse_args(argv)
    if not args.every_s > 0:
        parser.error("--every-s must be > 0")
    if args.duration_s is None:
        parser.error("--duration-s is required: it bounds both the workload and the kills")
    try:
        bench = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    return ChaosConfig(bench, args.ray_address, args.cluster_name, args.kill, args.every_s, args.reference, args.json)


def main(argv: list[str] | None = None) -> None:
    import ray

    from cluster.launcher import RAY_NAMESPACE, connect_controller

    config = parse_chaos(sys.argv[1:] if argv is None else argv)
    if not ray.is_initialized():
        ray.init(
            address=config.ray_address or "auto", namespace=RAY_NAMESPACE, configure_logging=False, log_to_driver=False
        )
    controller = connect_controller(config.cluster_name)
    if controller is None:
        sys.exit(f"splitserve chaos: no controller runs for cluster {config.cluster_name!r}")
    try:
        report = asyncio.run(run_chaos(config, controller))
    except BenchError as err:
        sys.exit(f"splitserve chaos: {err}")
    print(format_report(report))
    if config.json_out:
        with open(config.json_out, "w") as out:
            json.dump(report.to_dict(), out, indent=2)
    sys.exit(0 if report.clean else 1)
