"""What a worker reports about itself: Prometheus metrics (optionally on its own endpoint) and the
recent engine steps the router's cost models are fitted from. Shared by prefill and decode workers."""

from __future__ import annotations

from common.config import ClusterConfig
from common.messages import WorkerStats
from common.metric_identity import served_model_name
from common.metrics_http import start_metrics_server
from common.worker_metrics import WorkerMetrics
from engine.engine_loop import EngineLoop
from engine.models.moe import expert_token_counts
from engine.step_log import StepRecord

RECENT_STEPS = 64  # per stats() call; the router polls about once a second


class WorkerTelemetry:
    def __init__(self, worker_id: str, role: str, config: ClusterConfig, model_dir: str | None = None):
        pool = config.prefill if role == "prefill" else config.decode
        self.role = role
        model_name = served_model_name(model_dir, config.served_model_name) if model_dir is not None else None
        self.metrics = WorkerMetrics(worker_id, role, model_name=model_name)
        # Bound like the router (loopback unless the deployment opens it): one endpoint per actor.
        self.exporter = (
            start_metrics_server(self.metrics.registry, pool.metrics_port, config.router.host)
            if pool.metrics_port is not None
            else None
        )

    def on_step(self, record: StepRecord) -> None:
        """Engine-loop hook (engine thread)."""
        self.metrics.observe_step(self.role, record.duration_s, record.num_tokens)

    def stats(self, loop: EngineLoop, in_flight: int) -> WorkerStats:
        """Load as of the engine loop's last snapshot (never waits for a step), also set on the gauges,
        plus the recent steps."""
        load = loop.load
        self.metrics.set_load(load.waiting, load.running, load.num_blocks - load.num_free_blocks, load.num_blocks)
        if load.spec is not None:
            self.metrics.set_speculation(load.spec)
        self.metrics.set_preemptions(loop.engine.scheduler.num_preemptions)
        expert_load = expert_token_counts(loop.engine.runner.model)
        if expert_load:
            self.metrics.set_expert_load(expert_load)
        self.metrics.set_handoffs_in_flight(in_flight)
        return WorkerStats(
            load.waiting,
            load.running,
            load.num_free_blocks,
            load.num_blocks,
            loop.step_log.recent(RECENT_STEPS),
            in_flight,
            self.exporter.port if self.exporter is not None else None,
            load.spec,
        )

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.stop()
