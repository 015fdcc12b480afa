"""Waiting, bounded, until every worker of a cluster is back to an empty, consistent KV pool."""
from __future__ import annotations

import time

import ray


def worker_reports(cluster) -> dict[str, dict]:
    actors = {h.worker_id: h.actor for h in cluster.prefill}
    for instance in cluster.decode:
        actors.update({f"{instance.worker_id}/rank{r}": a for r, a in enumerate(instance.ranks)})
    return {name: ray.get(actor.check_integrity.remote(), timeout=10) for name, actor in actors.items()}


def wait_workers_clean(cluster, timeout_s: float = 15.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        reports = worker_reports(cluster)  # check_integrity raises inside the actor if the pool is broken
        dirty = {name: r for name, r in reports.items()
                 if r["num_free_blocks"] != r["num_blocks"] or r.get("num_sequences", 0)
                 or r.get("num_grammar_matchers", 0)}
        if not dirty:
            return
        if time.monotonic() > deadline_s:
            raise AssertionError(f"workers still hold blocks or sequences after {timeout_s} s: {dirty}")
        time.sleep(0.2)
