"""A burst of streaming requests sent from a process of its own, as real clients send them.

The admission tests measure TTFT where a client sees it. Sent from the test process, the 80 client
coroutines would share one interpreter lock with the router serving them (it runs on a thread of the
test process), and every first token would wait on the client's own work for the rest of the burst:
a cost no router can see, let alone predict. A separate process keeps only what a real client adds.

`burst(target, prompts, priorities, ttft_ms)` runs `python -m tests.router.burst_client` with the
requests as JSON on stdin and returns, per request in order, its `BurstResult`.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

BURST_TIMEOUT_S = 120.0
REPO_ROOT = Path(__file__).resolve().parents[2]


class BurstResult(NamedTuple):
    ttft_s: float | None  # None: rejected
    reason: str = ""  # the RESOURCE_EXHAUSTED reason of a rejected request
    retry_after_s: float | None = None

    @property
    def rejected(self) -> bool:
        return self.ttft_s is None


def burst(target: str, prompts: list[list[int]], priorities: list[int], ttft_ms: float) -> list[BurstResult]:
    payload = json.dumps({"target": target, "prompts": prompts, "priorities": priorities, "ttft_ms": ttft_ms})
    done = subprocess.run([sys.executable, "-m", "tests.router.burst_client"], input=payload, capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=BURST_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"burst client failed ({done.returncode}): {done.stderr[-2000:]}")
    return [BurstResult(*row) for row in json.loads(done.stdout)]


async def _send_all(target: str, prompts, priorities, ttft_ms: float) -> list[tuple]:
    from splitserve_client.client import AsyncClient
    from splitserve_client.sdk_types import ResourceExhausted

    async with AsyncClient(target, max_retries=0) as client:
        async def one(prompt, priority) -> tuple:
            started_s, ttft_s = time.perf_counter(), None
            try:
                async for _ in client.generate_stream(prompt, temperature=0.0, max_tokens=2, ignore_eos=True,
                                                      priority=priority, ttft_ms=ttft_ms, timeout_s=60):
                    ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started_s
                return (ttft_s, "", None)
            except ResourceExhausted as err:
                return (None, err.reason, err.retry_after_s)
        return list(await asyncio.gather(*(one(p, q) for p, q in zip(prompts, priorities))))


def main() -> None:
    request = json.load(sys.stdin)
    results = asyncio.run(_send_all(request["target"], request["prompts"], request["priorities"],
                                    request["ttft_ms"]))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
