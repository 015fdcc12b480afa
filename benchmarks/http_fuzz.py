"""The deeper fuzzing run of the HTTP front: schemathesis from the served OpenAPI document, for minutes.

It starts a 1 prefill + 1 decode cluster on a tiny random checkpoint (a context of `--context` tokens,
built with the test suite's factory, so it needs a source checkout) and a router in this process, runs
`st run` against `/openapi.json` with the same checks as tests/router/test_http_fuzz.py for `--time-s`
seconds, then sends one greedy request and waits for both workers' pools to be clean. It records the
cases sent per second (examples/s), the failures and errors schemathesis found (none expected), and
exits 1 when there are any.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.http_fuzz --time-s 600 --json docs/perf/http_fuzz/cpu.json

docs/performance.md ("HTTP front fuzzing") holds the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import platform
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def measure(time_s: int, max_examples: int, seed: int, context: int, workdir: Path) -> dict[str, Any]:
    import ray
    import schemathesis

    from cluster.launcher import launch
    from common.config import ClusterConfig, PoolConfig, RouterConfig
    from router.server import RouterServer

    # A source checkout's test helpers, not shipped: imported by name, so that mypy does not check the tests.
    factories = importlib.import_module("tests.factories")
    wait_workers_clean = importlib.import_module("tests.router.cleanliness").wait_workers_clean
    run_fuzz = importlib.import_module("tests.router.http_fuzz").run_fuzz

    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, namespace="splitserve")
    model_dir = factories.make_tiny_checkpoint(workdir / "model", factories.TinySpec(max_position_embeddings=context))
    pool = PoolConfig(num_cpus=0.5, num_kv_blocks=256, threads=1)
    config = ClusterConfig(prefill=pool, decode=pool, router=RouterConfig(port=0, http_port=0))
    cluster = launch(config, str(model_dir))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="router-loop", daemon=True)
    thread.start()
    try:
        server = asyncio.run_coroutine_threadsafe(RouterServer.start(cluster, config), loop).result(120)
        url = server.http.url
        load_before = os.getloadavg()[0]
        run = run_fuzz(url, workdir / "fuzz", max_time_s=time_s, max_examples=max_examples, seed=seed)
        load_after = os.getloadavg()[0]
        served_tokens = _serves(url)
        outcomes = _outcomes(url)
        wait_workers_clean(cluster, timeout_s=60)
        asyncio.run_coroutine_threadsafe(server.stop(grace_s=1.0), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        cluster.shutdown()
    report = run.report
    return {
        "machine": _cpu_model(),
        # The host's 1-minute load average before and after: a shared machine's other work slows the run.
        "load_average_1m": [round(load_before, 1), round(load_after, 1)],
        "schemathesis": schemathesis.__version__,
        "context_tokens": context,
        "time_budget_s": time_s,
        "max_examples_per_round": max_examples,
        "seed": seed,
        "running_time_s": round(run.running_time_s, 1),
        "test_cases": report["test_cases"],
        "examples_per_s": round(run.examples_per_s, 2),
        "router_outcomes": outcomes,
        "operations": report["operations"],
        "phases": report["phases"],
        "stop_reason": report["stop_reason"],
        "failures": report["failures"],
        "errors": report["errors"],
        "exit_code": run.exit_code,
        "after_fuzzing_greedy_request_tokens": served_tokens,
        "output_tail": run.output[-6000:] if run.exit_code else "",
    }


def _outcomes(url: str) -> dict[str, int]:
    """The router's requests by outcome (its requests_total counter), to see how many fuzzed bodies were served."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    counts: dict[str, int] = {}
    for match in re.finditer(r'^splitserve_router_requests_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', text, re.M):
        if float(match[2]):
            counts[match[1]] = counts.get(match[1], 0) + int(float(match[2]))
    return counts


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.machine()


def _serves(url: str) -> int:
    """Tokens of one greedy request after the run: the cluster still serves."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    deadline_s = time.monotonic() + 60
    while True:  # streams the fuzzer cut short may still be ending; a 429 then is a retry
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return len(json.load(reply)["choices"][0]["token_ids"])
        except urllib.error.HTTPError as err:
            if err.code != 429 or time.monotonic() > deadline_s:
                raise
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-s", type=int, default=600, help="schemathesis's time budget for the whole run")
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation and fuzzing round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=64, help="the tiny checkpoint's context length in tokens")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="http_fuzz") as tmp:
        result = measure(args.time_s, args.max_examples, args.seed, args.context, Path(tmp))
    cases = result["test_cases"]
    print(
        f"{cases['generated']} cases in {result['running_time_s']} s: {result['examples_per_s']} examples/s; "
        f"failures {len(result['failures'])}, errors {len(result['errors'])}; "
        f"router outcomes {result['router_outcomes']}; "
        f"after fuzzing a greedy request gave {result['after_fuzzing_greedy_request_tokens']} tokens"
    )
    if result["output_tail"]:
        print(result["output_tail"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if result["exit_code"] or result["failures"] or result["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
