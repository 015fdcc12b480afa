"""Routing decision time against the size of the prefill pool: scoring every worker vs the indexed walk.

    python -m benchmarks.bench_routing_decision [--workers 10 100 1000 10000] [--decisions 2000]
                                                [--json docs/perf/routing_decision/cpu.json]

Synthetic fleet: every worker holds a 2-block system prompt (the hot prefix every request shares, as
on the Mooncake trace) and the leading blocks (a random depth) of 3 of a pool of 32-block documents
(4 documents per worker in the pool), in a real in-process prefix index. Loads: queued prompt tokens
drawn from {0, 512, ..., 8192} (many ties), requests 0..4. Each decision asks for a random document
cut at a random depth; between decisions one random worker's load changes, as each routed request
changes one (the indexed walk pays its LoadBook update inside the timed call; the exhaustive policy
is handed the list). Columns: `cache_aware` scoring every worker (`ExhaustiveCacheAwarePolicy`, the
policy's definition), `cache_aware` walking holder levels over a LoadBook, and `least_loaded` on a
list vs on a LoadBook. Both algorithms see the same fleet and queries, in the same run; a first
untimed decision builds the `prefix_hash` ring (rebuilt only when membership changes).

Through the router's own objects (`WorkerChooser`: membership, monitor, ledger, cluster client; no
actors are called), on the same fleet with one decode instance per 4 prefill workers: `router_scan`
lists the healthy workers and their ledger loads per request and scans the decode pool (the router's
code before it kept `RoutableLoads`, kept here as the baseline), `router_books` decides over the books
with the policy walking worker by worker (a book without slots, as with a Redis index), and
`router_masked` is the router as it runs with its in-process index: the prefill book shares the index's
worker slots and the policy walks with masks.
Before each decision the ledger books one request on a random worker and releases the one booked 8
decisions before (inside the timed call: the books' updates are part of the decision's cost).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import cast

from cluster.client import ClusterClient
from cluster.cluster_view import ClusterView
from cluster.launcher import LaunchedCluster
from common.actor_api import ControllerHandle
from common.config import ClusterConfig
from common.kv_events import KVEventBatch
from common.membership import Member, Membership
from common.messages import WorkerInfo
from engine.block_hash import HashNamespace, hash_blocks
from policies.routing import LoadBook, RouteQuery, WorkerLoad, make_policy
from policies.routing.cache_aware import CacheAwarePolicy, ExhaustiveCacheAwarePolicy
from prefix_index.memory import InProcessPrefixIndex
from prefix_index.worker_slots import WorkerSlots
from router.ledger import RouteLedger
from router.stream_state import StreamState
from router.worker_choice import WorkerChooser
from router.worker_monitor import WorkerMonitor
from sim.drive import run_now

BLOCK_SIZE = 16
DOC_BLOCKS = 32
NS = HashNamespace("bench-routing", BLOCK_SIZE)


def build_fleet(workers: int, rng: random.Random):
    # The index's own slots (the router's arrangement), shared with the books of the masked arms; the
    # workers register in order, so prefill-w has slot w.
    index = InProcessPrefixIndex(lease_s=3600)
    system = [rng.randrange(32000) for _ in range(2 * BLOCK_SIZE)]
    docs = [system + [rng.randrange(32000) for _ in range((DOC_BLOCKS - 2) * BLOCK_SIZE)] for _ in range(4 * workers)]
    doc_hashes = [hash_blocks(NS, d) for d in docs]
    for w in range(workers):
        held = set(doc_hashes[0][:2])
        for doc in rng.sample(doc_hashes, 3):
            held.update(doc[: rng.randint(2, DOC_BLOCKS)])
        run_now(index.apply(KVEventBatch(f"prefill-{w}", 1, 1, (), tuple(held))))
    loads = [WorkerLoad(f"prefill-{w}", rng.randint(0, 4), 512 * rng.randint(0, 16)) for w in range(workers)]
    return index, docs, doc_hashes, loads


def percentiles(samples_ns: list[int]) -> dict:
    ordered = sorted(samples_ns)
    return {
        "p50_us": round(ordered[len(ordered) // 2] / 1000, 2),
        "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000, 2),
        "mean_us": round(statistics.fmean(ordered) / 1000, 2),
    }


def run_size(workers: int, decisions: int, seed: int) -> dict:
    rng = random.Random(seed)
    index, docs, doc_hashes, loads = build_fleet(workers, rng)
    queries = []
    for _ in range(decisions):
        d = rng.randrange(len(docs))
        cut = rng.randint(1, DOC_BLOCKS) * BLOCK_SIZE - rng.randrange(BLOCK_SIZE)
        queries.append(RouteQuery(tuple(doc_hashes[d][: cut // BLOCK_SIZE]), cut, BLOCK_SIZE, b"%d" % d))
    changes = [(rng.randrange(workers), rng.randint(0, 4), 512 * rng.randint(0, 16)) for _ in range(decisions)]
    # The exhaustive policy is slow at 10k workers: it decides on a prefix of the same queries.
    exhaustive_n = decisions if workers <= 1000 else max(decisions // 10, 100)
    result: dict = {"workers": workers}
    for name, policy, count, with_book in (
        ("cache_aware_exhaustive", ExhaustiveCacheAwarePolicy(index), exhaustive_n, False),
        ("cache_aware_indexed", CacheAwarePolicy(index), decisions, True),
        ("cache_aware_masked", CacheAwarePolicy(index), decisions, True),
        ("least_loaded_list", make_policy("least_loaded"), decisions, False),
        ("least_loaded_book", make_policy("least_loaded"), decisions, True),
    ):
        current = list(loads)
        book = LoadBook(current, index.slots if name == "cache_aware_masked" else None)
        run_now(policy.choose(queries[0], book if with_book else current))  # builds the ring: not timed
        gc.collect()
        choices, samples = [], []
        for query, (w, inflight, queued) in zip(queries[:count], changes[:count], strict=True):
            start = time.perf_counter_ns()
            if with_book:
                book.set(WorkerLoad(f"prefill-{w}", inflight, queued))
                choice = run_now(policy.choose(query, book))
            else:
                current[w] = WorkerLoad(f"prefill-{w}", inflight, queued)
                choice = run_now(policy.choose(query, current))
            samples.append(time.perf_counter_ns() - start)
            choices.append(choice)
        result[name] = percentiles(samples)
        result[name]["decisions"] = count
        result[name + "_choices"] = choices
    exhaustive, indexed = result.pop("cache_aware_exhaustive_choices"), result.pop("cache_aware_indexed_choices")
    masked = result.pop("cache_aware_masked_choices")
    result["cache_aware_same_choice"] = exhaustive == indexed[: len(exhaustive)] == masked[: len(exhaustive)]
    result["least_loaded_same_choice"] = result.pop("least_loaded_list_choices") == result.pop(
        "least_loaded_book_choices"
    )
    return result


NO_STREAM = cast(StreamState, None)  # only admission reads a booking's stream state; routing never does


def _member(role: str, slot: int) -> Member:
    worker_id = f"{role}-{slot}"
    info = WorkerInfo(worker_id, role, (worker_id,), 1024, BLOCK_SIZE, 8, "spec", "model", 4096, 32000, (2,))
    return Member(worker_id, role, 1, (), info)


class _WalkingPolicy(CacheAwarePolicy):
    """`cache_aware` offering the router no slots to share: its book keeps no masks (a Redis index's case)."""

    def holder_slots(self) -> WorkerSlots | None:
        return None


async def _scan_pick(chooser: WorkerChooser, query: RouteQuery):
    """The router's pick before `RoutableLoads`: list the healthy workers and their loads, scan decode."""
    healthy = [h for h in chooser.cluster.prefill if chooser.monitor.is_healthy(h.worker_id)]
    loads = [chooser.ledger.prefill_load(h.worker_id) for h in healthy]
    decision = await chooser.policy.choose(query, loads)
    prefill = next(h for h in healthy if h.worker_id == decision.worker_id)
    decodes = [d for d in chooser.cluster.decode if chooser.monitor.is_healthy(d.worker_id)]
    decode = min(decodes, key=lambda d: (chooser.client.decode_load(d.worker_id), d.worker_id))
    return prefill, decode, decision


def run_router(workers: int, decisions: int, seed: int) -> dict:
    """`router_scan` vs `router_books` on one fleet (module docstring)."""
    rng = random.Random(seed)
    index, docs, doc_hashes, _ = build_fleet(workers, rng)
    queries = []
    for _ in range(decisions):
        d = rng.randrange(len(docs))
        cut = rng.randint(1, DOC_BLOCKS) * BLOCK_SIZE - rng.randrange(BLOCK_SIZE)
        queries.append(RouteQuery(tuple(doc_hashes[d][: cut // BLOCK_SIZE]), cut, BLOCK_SIZE, b"%d" % d))
    decode_n = max(workers // 4, 1)
    bookings = [(f"prefill-{rng.randrange(workers)}", 512 * rng.randint(0, 16)) for _ in range(decisions)]
    # Listing the pool asks the membership for each worker, a scan each (quadratic): large fleets decide
    # a prefix of the prompts (100 at 1,000 workers, 10 at 10,000).
    scan_n = min(decisions, max(10, 100_000 // workers))
    result: dict = {"workers": workers, "decode_instances": decode_n}
    for name, count in (("router_scan", scan_n), ("router_books", decisions), ("router_masked", decisions)):
        members = tuple(_member("prefill", i) for i in range(workers)) + tuple(
            _member("decode", i) for i in range(decode_n)
        )
        # No controller: the view is never started (nothing watches), membership is what is given here.
        no_controller = cast(ControllerHandle, None)
        view = ClusterView(LaunchedCluster(ClusterConfig(), "", no_controller, Membership("bench", 1, members), False))
        monitor, ledger = WorkerMonitor(view), RouteLedger()
        policy = CacheAwarePolicy(index) if name == "router_masked" else _WalkingPolicy(index)
        chooser = WorkerChooser(view, policy, monitor, ledger, ClusterClient(view))
        assert (chooser.loads.prefill.slots is index.slots) == (name == "router_masked")
        pick = (lambda q, c=chooser: _scan_pick(c, q)) if name == "router_scan" else chooser._pick
        run_now(pick(queries[0]))  # builds the ring: not timed
        gc.collect()
        choices, samples = [], []
        for i, (query, (prefill_id, uncached)) in enumerate(zip(queries[:count], bookings[:count], strict=True)):
            start = time.perf_counter_ns()
            ledger.book(f"r{i}", prefill_id, "decode-0", uncached, NO_STREAM)
            if i >= 8:
                old_id, old_uncached = bookings[i - 8]
                ledger.release(f"r{i - 8}", old_id, "decode-0", old_uncached)
            prefill, decode, decision = run_now(pick(query))
            samples.append(time.perf_counter_ns() - start)
            choices.append((prefill.worker_id, decode.worker_id, decision))
        result[name] = percentiles(samples)
        result[name]["decisions"] = count
        result[name + "_choices"] = choices
    scan, books = result.pop("router_scan_choices"), result.pop("router_books_choices")
    masked = result.pop("router_masked_choices")
    result["router_same_choice"] = scan == books[: len(scan)] == masked[: len(scan)] and books == masked
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only-router", action="store_true", help="measure only the router's objects")
    args = parser.parse_args()
    rows = []
    for workers in args.workers:
        row = {} if args.only_router else run_size(workers, args.decisions, args.seed)
        row |= run_router(workers, args.decisions, args.seed)
        rows.append(row)
        print(json.dumps(row))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"machine": platform.processor() or platform.machine(), "args": vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps(report | {"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
