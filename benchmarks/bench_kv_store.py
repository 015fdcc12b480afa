"""What the shared KV store buys a migrated request: its stall, against its context length.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_kv_store [--contexts 512 2048 8192]
        [--decode-tp 1] [--json docs/perf/kv_store_migration/<hardware>.json]

One local Ray cluster per mode, both up at once and used in turn (1 prefill worker, 2 decode
instances, a router each) over the demo model's shape with room for 8k-token contexts (random
weights), CPU. Per context length: one greedy stream.
After 16 tokens, decoding is slowed to a crawl (so the stream is still running at the kill), another
prompt passes through the prefill worker and evicts the stream's prompt from its pool (as a busy pool
does), and the decode instance serving the stream is SIGKILLed; the router migrates it, and the
stream is closed 8 tokens later. The stall is the longest wait for a token from the kill on. Modes:
`recompute` (no store: the resumed request computes its whole context again) and `store` (a
redis-server as `kv_store.url`: prefill stored the prompt's blocks, decode stored the generated ones
as they filled, and the resumed request fetches them). Both modes must produce the same tokens
(checked). `--decode-tp 2`: decode instances of two ranks (each rank stores its KV heads of each block;
the SIGKILL hits rank 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import ray

from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig, RouterConfig
from common.kv_store_config import KVStoreConfig
from engine.demo_model import write_demo_model
from router.server import RouterServer
from splitserve_client.client import Client

BLOCK = 16
MAX_TOKENS = 64  # never reached: the stream is closed a few tokens after it resumed
KILL_AFTER_TOKENS = 16
TOKENS_AFTER_KILL = 8  # read after the migration, then the stream is closed
CRAWL_STEP_S = 5.0  # decode step delay while the evictor runs, so the stream is still going at the kill
EVICTOR_TOKENS = 8192  # as many as the prefill pool holds: whatever context ran before is evicted (--evictor-tokens)


class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline_s = time.monotonic() + 10
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc, f"redis://127.0.0.1:{port}/0"
        if time.monotonic() > deadline_s:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.02)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]


def _stream(target: str, prompt: list[int], rid: str, max_tokens: int = MAX_TOKENS, progress=None):
    """(tokens, arrival times, migrations) of one greedy stream; `progress(tokens, route)` after each chunk
    returns True to close the stream."""
    tokens: list[int] = []
    arrivals: list[float] = []
    migrations, route = 0, None
    with Client(target, max_retries=0, timeout_s=900) as client:
        for chunk in client.generate_stream(
            prompt, request_id=rid, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ):
            now = time.perf_counter()
            route = route or chunk.route
            tokens.extend(chunk.token_ids)
            arrivals.extend([now] * len(chunk.token_ids))
            migrations = max(migrations, chunk.migrations or 0)
            if progress is not None and progress(len(tokens), route):
                break
    return tokens, arrivals, migrations


class _Mode:
    """One mode's cluster and router (and redis-server for `store`), kept up across the contexts."""

    def __init__(self, model_dir: Path, mode: str, workdir: Path, largest_tokens: int, decode_tp: int = 1):
        self.mode = mode
        self.redis_proc: subprocess.Popen | None = None
        url = None
        if mode == "store":
            self.redis_proc, url = _redis(workdir)
        blocks = (largest_tokens + MAX_TOKENS) // BLOCK + 8
        config = ClusterConfig(
            prefill=PoolConfig(num_cpus=0.5, threads=1, num_kv_blocks=blocks + 4),  # one context at a time
            decode=PoolConfig(num_cpus=0.5, threads=1, num_kv_blocks=2 * blocks, replicas=2, tp_size=decode_tp),
            block_size=BLOCK,
            ready_timeout_s=600.0,
            request_timeout_s=900.0,
            handoff_lease_s=120.0,
            router=RouterConfig(port=0, http_port=None),
            kv_store=KVStoreConfig(url=url, timeout_s=5.0),
        )
        self.cluster = launch(config, str(model_dir))
        self.loop = _Loop()
        self.server = self.loop.call(RouterServer.start(self.cluster, config))

    def wait_full_strength(self) -> None:
        deadline_s = time.monotonic() + 300  # the killed instance is back before the next context
        while len(self.server.service.cluster.membership.decode) < 2 and time.monotonic() < deadline_s:
            time.sleep(0.2)

    def tier_stats(self) -> list[dict]:
        members = self.server.service.cluster.membership.members
        return ray.get([m.actor.kv_tier_stats.remote() for m in members], timeout=30)

    def close(self) -> None:
        self.loop.call(self.server.stop(grace_s=1.0))
        self.loop.close()
        self.cluster.shutdown()
        if self.redis_proc is not None:
            self.redis_proc.kill()
            self.redis_proc.wait(10)


def _one_context(server, mode: str, length: int, vocab: int, evictor_tokens: int) -> dict:
    """One stream of a `length`-token prompt whose decode instance is killed mid-stream."""
    prompt, evictor = _tokens(length, length, vocab), _tokens(evictor_tokens, length + 1, vocab)
    members = server.service.cluster.membership
    kill_at: dict[str, float] = {}
    started = threading.Event()

    def progress(count: int, route) -> bool:
        if count >= KILL_AFTER_TOKENS and not started.is_set():
            started.set()
            for decode in members.decode:  # decoding crawls while the prompt leaves the prefill pool
                ray.get(decode.actor.debug_set_step_delay.remote(CRAWL_STEP_S), timeout=30)
            threading.Thread(target=kill, args=(route,), daemon=True).start()
        return "s" in kill_at and count >= kill_at["count"] + TOKENS_AFTER_KILL

    def kill(route) -> None:
        _stream(server.address, evictor, f"evict-{mode}-{length}", max_tokens=1)
        victim = next(d for d in members.decode if d.worker_id == route.decode_instance)
        for decode in members.decode:  # the survivor is back at full speed before the kill
            if decode is not victim:
                ray.get(decode.actor.debug_set_step_delay.remote(0.0), timeout=30)
        time.sleep(CRAWL_STEP_S)
        kill_at["count"] = len(tokens_seen)
        kill_at["s"] = time.perf_counter()
        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get(victim.actor.debug_signal.remote(signal.SIGKILL), timeout=30)

    tokens_seen: list[int] = []

    def track(count: int, route) -> bool:
        tokens_seen[:] = range(count)
        return progress(count, route)

    tokens, arrivals, _ = _stream(server.address, prompt, f"s-{mode}-{length}", progress=track)
    # the longest wait for a token from the kill on (a token the dead instance had in flight may still
    # arrive just after it; the migrated request's first token ends the real gap)
    times = [kill_at["s"], *(t for t in arrivals if t > kill_at["s"])]
    stall_ms = max((b - a) * 1e3 for a, b in itertools.pairwise(times)) if len(times) > 1 else float("nan")
    print(f"{mode:<9} context {length:>5}: stall {stall_ms:8.0f} ms", flush=True)
    compared = tokens[: KILL_AFTER_TOKENS + TOKENS_AFTER_KILL]  # the same count in every mode
    return {"context_tokens": length, "stall_ms": stall_ms, "tokens": compared}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--evictor-tokens", type=int, default=EVICTOR_TOKENS, help="the evicting prompt's length")
    parser.add_argument("--decode-tp", type=int, default=1, help="ranks per decode instance")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-kv-store-"))
    model_dir = write_demo_model(
        workdir / "model",
        progress=False,
        config_overrides={"max_position_embeddings": max(*args.contexts, args.evictor_tokens) + 2 * MAX_TOKENS},
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    largest = max(*args.contexts, args.evictor_tokens)
    modes = [_Mode(model_dir, mode, workdir, largest, args.decode_tp) for mode in ("recompute", "store")]
    rows: dict[str, list[dict]] = {mode.mode: [] for mode in modes}
    try:  # the modes alternate per context, so both see the same machine
        for length in args.contexts:
            for mode in modes:
                rows[mode.mode].append(_one_context(mode.server, mode.mode, length, vocab, args.evictor_tokens))
                mode.wait_full_strength()
        tier_stats = modes[1].tier_stats()
    finally:
        for mode in modes:
            mode.close()
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    recompute, store = ({r["context_tokens"]: r for r in rows[m]} for m in ("recompute", "store"))
    same = all(recompute[n]["tokens"] == store[n]["tokens"] for n in args.contexts)
    print(f"same tokens in both modes: {same}")
    summary = [
        {"context_tokens": n, "recompute_stall_ms": recompute[n]["stall_ms"], "store_stall_ms": store[n]["stall_ms"]}
        for n in args.contexts
    ]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as out:
            figures = {"summary": summary, "same_tokens": same, "decode_tp_size": args.decode_tp}
            json.dump({**figures, "store_tier_stats": tier_stats}, out, indent=1)


if __name__ == "__main__":
    main()
