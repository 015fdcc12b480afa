"""How fast the controller repairs the cluster: SIGKILL a worker, time until routers' membership excludes
it, and until its replacement serves (and answers a request).

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_recovery [--kills 5] [--json out.json]

One local Ray cluster of 1 prefill worker + 1 decode instance over the demo checkpoint (CPU). The
clock starts right before the SIGKILL (sent by the worker to itself, as `splitserve chaos` does) and
is read from a router's own `ClusterView` (the membership a router routes by), so both figures include
the controller's detection and the watch round trip. "Serving" is when the replacement is in
membership; "answered" adds one greedy request through it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time

import ray

from cluster.client import ClusterClient
from cluster.cluster_view import ClusterView
from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig
from common.messages import GenerateRequest
from engine.sampling_params import SamplingParams

POOL = PoolConfig(num_cpus=0.5, threads=1, num_kv_blocks=512)


async def _until(view: ClusterView, predicate, timeout_s: float) -> float:
    started_s = time.monotonic()
    while not predicate(view.membership):
        if time.monotonic() - started_s > timeout_s:
            raise TimeoutError("membership did not change in time")
        await asyncio.sleep(0.005)
    return time.monotonic()


async def _kill_once(view: ClusterView, client: ClusterClient, role: str, index: int) -> dict:
    victim = getattr(view.membership, role)[0]
    gone = lambda m: (cur := m.get(victim.worker_id)) is None or cur.epoch != victim.epoch  # noqa: E731
    back = lambda m: (cur := m.get(victim.worker_id)) is not None and cur.epoch > victim.epoch  # noqa: E731
    started_s = time.monotonic()
    victim.actor.debug_signal.remote(signal.SIGKILL)
    dropped_s = await _until(view, gone, 30) - started_s
    serving_s = await _until(view, back, 300) - started_s
    request = GenerateRequest(f"probe-{role}-{index}", (1, 2, 3, 4, 5), SamplingParams(max_tokens=4, ignore_eos=True))
    async for _ in client.generate(request):
        pass
    answered_s = time.monotonic() - started_s
    return {"role": role, "dropped_s": dropped_s, "serving_s": serving_s, "answered_s": answered_s}


async def _run(launched, kills: int) -> list[dict]:
    view = ClusterView(launched)
    view.start()
    client = ClusterClient(view)
    results = []
    try:
        for role in ("prefill", "decode"):
            for index in range(kills):
                result = await _kill_once(view, client, role, index)
                print(
                    f"{role:<8} kill {index + 1}: out of membership {result['dropped_s'] * 1e3:7.0f} ms, "
                    f"replacement serving {result['serving_s']:6.2f} s, answered {result['answered_s']:6.2f} s",
                    flush=True,
                )
                results.append(result)
    finally:
        await client.close()
        await view.close()
    return results


def _summary(results: list[dict]) -> dict:
    summary = {}
    for role in ("prefill", "decode"):
        rows = [r for r in results if r["role"] == role]
        summary[role] = {
            key: {"mean": statistics.fmean(r[key] for r in rows), "max": max(r[key] for r in rows)}
            for key in ("dropped_s", "serving_s", "answered_s")
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs per role (default 5)")
    parser.add_argument("--json", help="write per-kill figures and the summary here")
    args = parser.parse_args(argv)
    launched = launch(ClusterConfig(prefill=POOL, decode=POOL, ready_timeout_s=300.0))
    try:
        results = asyncio.run(_run(launched, args.kills))
    finally:
        launched.shutdown()
    summary = _summary(results)
    for role, figures in summary.items():
        print(
            f"{role:<8} mean/max: out of membership {figures['dropped_s']['mean'] * 1e3:.0f}/"
            f"{figures['dropped_s']['max'] * 1e3:.0f} ms, serving {figures['serving_s']['mean']:.2f}/"
            f"{figures['serving_s']['max']:.2f} s, answered {figures['answered_s']['mean']:.2f}/"
            f"{figures['answered_s']['max']:.2f} s"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"kills": results, "summary": summary}, out, indent=2)
    if ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    main()
