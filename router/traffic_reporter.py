"""A router's traffic, counted on the request path and reported to the controller's planner.

The planner runs in the controller (cluster/planner_loop.py says why); each router only counts what
it served (`common.traffic.TrafficCounts`: arrivals with their prompt tokens, finished requests
with their output tokens and whether they met the planner's SLO) and sends its cumulative counters
every `planner.report_interval_s`. Cumulative: a report that fails (controller restarting) is simply
superseded by the next. With the planner off nothing is counted and nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from common.actor_api import ControllerHandle
from common.planner_config import PlannerConfig
from common.traffic import TrafficCounts
from router.metrics import slo_met

log = logging.getLogger(__name__)


class TrafficReporter:
    def __init__(self, controller: ControllerHandle, config: PlannerConfig):
        self.controller, self.config = controller, config
        self.router_id = secrets.token_hex(4)
        self.counts = TrafficCounts()
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def arrived(self, prompt_tokens: int) -> None:
        if self.enabled:
            c = self.counts
            self.counts = TrafficCounts(
                c.arrivals + 1, c.prompt_tokens + prompt_tokens, c.finished, c.output_tokens, c.slo_met
            )

    def finished(self, output_tokens: int, ttft_s: float, tpot_s: float | None) -> None:
        if self.enabled:
            met = slo_met(ttft_s, tpot_s, self.config.ttft_ms, self.config.tpot_ms)
            c = self.counts
            self.counts = TrafficCounts(
                c.arrivals, c.prompt_tokens, c.finished + 1, c.output_tokens + output_tokens, c.slo_met + int(met)
            )

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.ensure_future(self._report_forever())

    async def _report_forever(self) -> None:
        interval_s = self.config.report_interval_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                await asyncio.wait_for(
                    self.controller.report_traffic(self.router_id, self.counts), max(interval_s, 1.0)
                )
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the next report carries these counts too
                log.warning("traffic report to the controller failed: %s", type(err).__name__)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
