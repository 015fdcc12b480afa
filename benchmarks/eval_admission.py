"""Goodput vs offered load with admission `always` and `predictive`, on a small real cluster.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.eval_admission --out docs/perf/admission

1. Launches 1 prefill + 1 decode actor over a shrunken demo model (prefill compute is the bottleneck,
   as on a real cluster, at a rate a 2-core box reaches) and serves a router with admission
   `predictive` on this process's event loop. Load comes from `splitserve bench` subprocesses, so the
   router's loop serves the router only.
2. Measures a solo TTFT and TPOT (sequential requests); unless given, the SLOs are `--ttft-slo-x` and
   `--tpot-slo-x` times them. Goodput counts requests meeting both.
3. Warms the cost models up at a low rate, then climbs the offered rate by `--step` from `--start-rate`
   under `always` until goodput stops growing (`admission_report.saturation_rate`).
4. At each `--loads` multiple of that rate runs both policies on the same router and cluster (the gate's
   policy is swapped), alternating which goes first from load to load so that drift hits both alike.
Every point is one Poisson run of at most `--duration-s` seconds and `--max-requests` requests; then
the router drains before the next. Writes eval_admission.json and two PNGs under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtest.admission_report import Point, format_table, format_targets, saturation_rate, targets

PROMPT_LEN = "uniform:192,320"
OUTPUT_TOKENS = 16


def _small_model(layers: int, hidden: int) -> str:
    from engine.demo_model import write_demo_model

    out = tempfile.mkdtemp(prefix="splitserve-eval-model-")
    write_demo_model(
        out,
        progress=False,
        config_overrides={
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    )
    return out


async def _bench(target: str, rate: float, args, seed: int, out_dir: Path) -> dict:
    """One `splitserve bench` run in a subprocess; its summary.json."""
    requests = max(1, min(args.max_requests, math.ceil(rate * args.duration_s)))
    flags = [
        "--target",
        target,
        "--workload",
        "poisson",
        "--rate",
        f"{rate:.4f}",
        "--num-requests",
        str(requests),
        "--duration-s",
        str(args.duration_s),
        "--grace-s",
        str(args.grace_s),
        "--prompt-len",
        PROMPT_LEN,
        "--output-len",
        f"fixed:{OUTPUT_TOKENS}",
        "--ttft-ms",
        f"{args.ttft_ms:.1f}",
        "--tpot-ms",
        f"{args.tpot_ms:.1f}",
        "--max-concurrency",
        "1024",
        "--seed",
        str(seed),
        "--no-progress",
        "--out",
        str(out_dir),
    ]
    command = [sys.executable, "-c", "from loadtest.cli import main; main()", *flags]
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.DEVNULL)
    if await asyncio.wait_for(process.wait(), args.duration_s + args.grace_s + 120) != 0:
        raise RuntimeError(f"splitserve bench failed ({process.returncode}): {' '.join(flags)}")
    return json.loads((out_dir / "summary.json").read_text())


async def _drain(service, timeout_s: float = 60.0) -> None:
    """Waits until the router has nothing in flight (cancelled requests included), bounded."""
    deadline_s = time.monotonic() + timeout_s
    while service.inflight_requests and time.monotonic() < deadline_s:  # noqa: ASYNC110 - no idle event to wait on
        await asyncio.sleep(0.1)
    await service.monitor.probe_all()  # the cost models see the steps of the run just ended


def _failed(summary: dict) -> int:
    """Requests that ended neither completed nor rejected by admission (overload must not cause any)."""
    rejected = round((summary["rejection_rate"] or 0.0) * summary["requests_measured"])
    return summary["requests_failed"] - rejected


class Evaluation:
    def __init__(self, service, target: str, args):
        self.service, self.target, self.args = service, target, args
        self.seed = 0
        self.saturation_per_s = 1.0

    async def point(self, policy: str, rate: float) -> Point:
        from policies.admission import make_admission_policy

        gate = self.service.admission
        gate.policy = make_admission_policy(policy, config=gate.config)
        self.seed += 1  # fresh prompts per run: no run hits the prefix cache another filled
        folder = Path(self.args.work_dir) / f"{policy}-{self.seed:02d}-rate-{rate:.2f}"
        s = await _bench(self.target, rate, self.args, self.seed, folder)
        await _drain(self.service)
        point = Point(
            policy,
            rate,
            rate / self.saturation_per_s,
            s["goodput_per_s"] or 0.0,
            s["slo_attainment"] or 0.0,
            s["rejection_rate"] or 0.0,
            s["request_throughput_per_s"] or 0.0,
            s["ttft_ms"]["p99"],
            _failed(s),
        )
        print(
            f"  {policy:>10} {rate:6.2f} req/s: goodput {point.goodput_per_s:.2f}/s, attainment "
            f"{point.attainment:.0%}, rejected {point.rejection_rate:.0%}, failed {point.failed}",
            flush=True,
        )
        return point

    async def find_saturation(self) -> tuple[float, list[tuple[float, float]]]:
        climb: list[tuple[float, float]] = []
        rate = self.args.start_rate
        for _ in range(self.args.max_climb_steps):
            climb.append((rate, (await self.point("always", rate)).goodput_per_s))
            found = saturation_rate(climb, self.args.min_gain)
            if found is not None:
                return found, climb
            rate *= self.args.step
        raise RuntimeError(f"goodput still grew at {rate / self.args.step:g} req/s: raise --start-rate or --step")

    async def sweep(self) -> list[Point]:
        points = []
        for i, load in enumerate(self.args.loads):
            order = ("always", "predictive") if i % 2 == 0 else ("predictive", "always")
            points.extend([await self.point(policy, load * self.saturation_per_s) for policy in order])
        return points


async def _solo(target: str, args) -> tuple[float, float]:
    """Median TTFT and TPOT (ms) of sequential requests of the workload's mean prompt length."""
    import random

    from splitserve_client.client import AsyncClient

    rng = random.Random(7)
    ttfts, tpots = [], []
    async with AsyncClient(target, max_retries=0) as client:
        for _ in range(args.solo_requests):
            prompt = [rng.randrange(10, 4000) for _ in range(256)]
            started_s = time.perf_counter()
            times = [
                time.perf_counter() - started_s
                async for _ in client.generate_stream(
                    prompt, temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True
                )
            ]
            ttfts.append(times[0])
            tpots.append((times[-1] - times[0]) / max(len(times) - 1, 1))
    return statistics.median(ttfts) * 1e3, statistics.median(tpots) * 1e3


async def _evaluate(service, target: str, args) -> dict:
    solo_ttft_ms, solo_tpot_ms = await _solo(target, args)
    args.ttft_ms = args.ttft_ms or args.ttft_slo_x * solo_ttft_ms
    args.tpot_ms = args.tpot_ms or args.tpot_slo_x * solo_tpot_ms
    print(
        f"solo TTFT {solo_ttft_ms:.1f} ms, TPOT {solo_tpot_ms:.2f} ms -> SLO TTFT {args.ttft_ms:.0f} ms, "
        f"TPOT {args.tpot_ms:.1f} ms",
        flush=True,
    )
    evaluation = Evaluation(service, target, args)
    await evaluation.point("predictive", args.start_rate)  # warm-up: cost models and observed TTFTs
    print("finding the saturation rate under always:", flush=True)
    evaluation.saturation_per_s, climb = await evaluation.find_saturation()
    print(f"saturation: {evaluation.saturation_per_s:.2f} req/s; sweeping loads {list(args.loads)}", flush=True)
    points = await evaluation.sweep()
    return {
        "solo_ttft_ms": solo_ttft_ms,
        "solo_tpot_ms": solo_tpot_ms,
        "ttft_slo_ms": args.ttft_ms,
        "tpot_slo_ms": args.tpot_ms,
        "saturation_per_s": evaluation.saturation_per_s,
        "climb": climb,
        "points": [p.to_dict() for p in points],
        "targets": targets(points),
        "model": {"layers": args.layers, "hidden": args.hidden},
        "prompt_len": PROMPT_LEN,
        "output_tokens": OUTPUT_TOKENS,
        "duration_s": args.duration_s,
    }


async def _serve_and_evaluate(args) -> dict:
    from cluster.launcher import launch
    from common.config import ClusterConfig, PoolConfig, RouterConfig
    from policies.admission import AdmissionConfig
    from router.server import RouterServer

    pool = PoolConfig(num_cpus=1.0, threads=1)
    admission = AdmissionConfig(policy="predictive")
    config = ClusterConfig(
        prefill=pool,
        decode=pool,
        router=RouterConfig(port=0, http_port=None),
        ray_num_cpus=4,
        admission=admission,
        ready_timeout_s=180.0,
    )
    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(None, launch, config, args.model or _small_model(args.layers, args.hidden))
    try:
        server = await RouterServer.start(cluster, config)
        try:
            return await _evaluate(server.service, server.address, args)
        finally:
            await server.stop(1.0)
    finally:
        cluster.shutdown()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for eval_admission.json and the PNG plots")
    parser.add_argument("--model", help="checkpoint directory (default: a shrunken demo model)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ttft-ms", type=float, help="TTFT SLO (default: --ttft-slo-x x the solo TTFT)")
    parser.add_argument("--tpot-ms", type=float, help="TPOT SLO (default: --tpot-slo-x x the solo TPOT)")
    parser.add_argument("--ttft-slo-x", type=float, default=5.0)
    parser.add_argument("--tpot-slo-x", type=float, default=5.0)
    parser.add_argument("--start-rate", type=float, default=4.0, help="req/s where the climb starts")
    parser.add_argument("--step", type=float, default=1.5, help="rate factor per climb step")
    parser.add_argument("--min-gain", type=float, default=0.1, help="relative goodput gain that counts as growth")
    parser.add_argument("--max-climb-steps", type=int, default=8)
    parser.add_argument(
        "--loads",
        type=lambda s: tuple(float(v) for v in s.split(",")),
        default=(0.5, 1, 1.5, 2, 3),
        help="offered loads to sweep, as multiples of the saturation rate",
    )
    parser.add_argument("--duration-s", type=float, default=8.0, help="issuing time per point")
    parser.add_argument("--grace-s", type=float, default=5.0, help="then cancel what is still open")
    parser.add_argument("--max-requests", type=int, default=400, help="requests per point at most")
    parser.add_argument("--solo-requests", type=int, default=8)
    parser.add_argument("--runs-dir", help="keep each point's records.jsonl + summary.json here (default: dropped)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="splitserve-eval-runs-") as work_dir:
        args.work_dir = args.runs_dir or work_dir
        started_s = time.perf_counter()
        result = asyncio.run(_serve_and_evaluate(args))
    points = [Point(**p) for p in result["points"]]
    result["wall_s"] = time.perf_counter() - started_s
    print("\n" + format_table(points) + "\n" + format_targets(result["targets"]))
    (out / "eval_admission.json").write_text(json.dumps(result, indent=2) + "\n")
    from loadtest.plots import plot_policy_comparison

    written = plot_policy_comparison(points, out, result["saturation_per_s"])
    print(f"wall {result['wall_s']:.0f} s; wrote {out / 'eval_admission.json'}, " + ", ".join(map(str, written)))
    return result


if __name__ == "__main__":
    main()
