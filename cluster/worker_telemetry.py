"""What a worker reports about itself: Prometheus metrics (optionally on its own endpoint) and the
recent engine steps the router's cost models are fitted from. Shared by prefill and decode workers."""
from __future__ import annotations

import dataclasses

from cluster.config import ClusterConfig
from cluster.metrics_http import start_metrics_server
from cluster.worker_metrics import WorkerMetrics
from engine.step_log import StepRecord

RECENT_STEPS = 64  # per stats() call; the router polls about once a second


class WorkerTelemetry:
    def __init__(self, worker_id: str, role: str, config: ClusterConfig):
        pool = config.prefill if role == "prefill" else config.decode
        self.role = role
        self.metrics = WorkerMetrics(worker_id, role)
        # Bound like the router (loopback unless the deployment opens it): one endpoint per actor.
        self.exporter = (start_metrics_server(self.metrics.registry, pool.metrics_port, config.router.host)
                         if pool.metrics_port is not None else None)

    def on_step(self, record: StepRecord) -> None:
        """Engine-loop hook (engine thread)."""
        self.metrics.observe_step(self.role, record.duration_s, record.num_tokens)

    def engine_stats(self, engine, step_log) -> dict:
        """Runs on the engine thread: load figures, also set on the gauges, plus the recent steps."""
        used = engine.num_blocks - engine.kv.num_free_blocks
        waiting, running = len(engine.scheduler.waiting), len(engine.scheduler.running)
        self.metrics.set_load(waiting, running, used, engine.num_blocks)
        return {"waiting": waiting, "running": running, "kv_usage": engine.kv.usage,
                "num_free_blocks": engine.kv.num_free_blocks, "num_blocks": engine.num_blocks,
                "steps": [dataclasses.astuple(r) for r in step_log.recent(RECENT_STEPS)],
                "metrics_port": self.exporter.port if self.exporter is not None else None}

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.stop()
