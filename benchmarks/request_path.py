"""How far one request travels: the product's source files it executes from the HTTP handler to its last
token, and the calls that cross a process boundary on the way.

It starts a 1 prefill + 1 decode cluster on the demo model and a router in this process, sends one streamed
`/v1/completions` request, and records, in the router and in every worker process, which repository files
ran Python code while the request was in flight (a profile hook, `sys.setprofile`, installed in the
workers by Ray's `worker_process_setup_hook`) and which actor methods were called (Ray's `ActorMethod`).
Files are counted per process and in all. Background work runs in the same window (health pings, load
probes, prefix-index polls): its calls are listed apart, and the few files only it runs are counted too,
so the file count is an upper bound of the request's own path.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.request_path [--json OUT]

docs/performance.md ("Request path") holds the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PRODUCT_ROOT = str(REPO) + os.sep
# The actor methods the router and the workers call for one request (the rest is background: pings, load
# probes, KV-event polls, membership pushes).
BACKGROUND_METHODS = frozenset({"ping", "stats", "read_kv_events", "set_membership", "watch", "membership"})

_files: set[str] = set()
_calls: list[str] = []
_recording = threading.Event()


def _profile(frame, event, arg):
    if _recording.is_set():
        name = frame.f_code.co_filename
        if name.startswith(PRODUCT_ROOT) and "/.venv" not in name and "/benchmarks/" not in name:
            _files.add(os.path.relpath(name, REPO))


def install_hooks() -> None:
    """In a process of the cluster: record executed product files and actor calls while recording is on."""
    import ray.actor

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    original = ray.actor.ActorMethod._remote

    def remote(self, *args, **kwargs):
        if _recording.is_set():
            _calls.append(self._method_name)
        return original(self, *args, **kwargs)

    ray.actor.ActorMethod._remote = remote  # type: ignore[method-assign]


def _set_recording(_actor, on: bool) -> None:
    if on:
        _files.clear()
        _calls.clear()
        _recording.set()
    else:
        _recording.clear()


def _recorded(_actor) -> tuple[list[str], list[str]]:
    return sorted(_files), list(_calls)


def _worker_handles(cluster) -> list[tuple[str, Any]]:
    return [
        (f"{m.role}:{m.worker_id}/rank{i}", rank) for m in cluster.membership.members for i, rank in enumerate(m.ranks)
    ]


async def _one_request(http_url: str) -> int:
    import aiohttp

    body = {"prompt": "Once upon a time", "max_tokens": 16, "stream": True, "temperature": 0}
    chunks = 0
    async with aiohttp.ClientSession() as session, session.post(f"{http_url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            chunks += line.startswith(b"data: ")
    return chunks


def measure() -> dict:
    import ray

    from cluster.launcher import launch
    from common.config import ClusterConfig, PoolConfig, RouterConfig
    from router.server import RouterServer

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        configure_logging=False,
        namespace="splitserve",
        runtime_env={"worker_process_setup_hook": "benchmarks.request_path.install_hooks"},
    )
    pool = PoolConfig(num_cpus=0.5, num_kv_blocks=256, threads=1)
    config = ClusterConfig(prefill=pool, decode=pool, router=RouterConfig(port=0, http_port=0))
    cluster = launch(config)
    install_hooks()
    loop = asyncio.new_event_loop()
    try:
        server = loop.run_until_complete(RouterServer.start(cluster, config))
        loop.run_until_complete(_one_request(server.http.url))  # warm: first-use imports and compilations
        workers = _worker_handles(cluster)
        ray.get([rank.__ray_call__.remote(_set_recording, True) for _, rank in workers], timeout=30)
        _set_recording(None, True)
        chunks = loop.run_until_complete(_one_request(server.http.url))
        _set_recording(None, False)
        ray.get([rank.__ray_call__.remote(_set_recording, False) for _, rank in workers], timeout=30)
        per_process: dict[str, Any] = {"router": _recorded(None)}
        for name, rank in workers:
            per_process[name] = ray.get(rank.__ray_call__.remote(_recorded), timeout=30)
        loop.run_until_complete(server.stop(grace_s=1.0))
    finally:
        loop.close()
        cluster.shutdown()
    return _report(per_process, chunks)


def _report(per_process: dict[str, tuple[list[str], list[str]]], chunks: int) -> dict:
    processes = {}
    path_calls: list[str] = []
    all_files: set[str] = set()
    for name, (files, calls) in per_process.items():
        request_calls = [c for c in calls if c not in BACKGROUND_METHODS]
        path_calls += [f"{name.split(':')[0]} -> {c}" for c in request_calls]
        all_files.update(files)
        processes[name] = {
            "files": files,
            "num_files": len(files),
            "request_calls": sorted(set(request_calls)),
            "background_calls": sorted(set(calls) - set(request_calls)),
        }
    hops = sorted(set(path_calls))
    return {
        "sse_chunks": chunks,
        "num_files": len(all_files),
        "num_cross_process_call_kinds": len(hops),
        "cross_process_calls": hops,
        "processes": processes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args(argv)
    # By module name, not as __main__: Ray pickles the functions it runs in the workers by reference.
    from benchmarks import request_path

    report = request_path.measure()
    print(f"files executed while the request was in flight: {report['num_files']}")
    for name, proc in report["processes"].items():
        print(f"  {name}: {proc['num_files']} files; calls made: {proc['request_calls']}")
    print(f"cross-process call kinds on the request path: {report['num_cross_process_call_kinds']}")
    for hop in report["cross_process_calls"]:
        print(f"  {hop}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
