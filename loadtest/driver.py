"""The load driver: issues a `Plan` open-loop against a server through a backend (`loadtest.backends`).

1. Request i is due at start + arrival_s whatever happened to earlier ones (open loop: a slow cluster
   does not slow the offered load). At most `max_concurrency` streams are open at once; a due request
   waits for a slot, and its `send_s` records when it got one (arrival_s keeps when it was due).
2. Issuing stops when the plan is exhausted or, with `duration_s`, at start + duration_s (requests due
   later are counted as not issued). Requests still open `grace_s` after that are cancelled and
   recorded with error code CANCELLED and the tokens they got; without `duration_s` the driver waits
   for every request (each is bounded by `request_timeout_s` in the SDK).
3. Every request has an id `{run_tag}-{index:06d}` (unique per run, so that the router's duplicate
   check never fires across runs), ignores EOS so that its output length is exactly max_tokens, and is
   recorded by a `RequestRecorder`; a backend's `RequestError` becomes (status name, reason).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from tqdm import tqdm

from loadtest.backends import RequestError, RequestOptions
from loadtest.plan import Plan, PlannedRequest
from loadtest.recorder import RequestRecorder
from loadtest.records import RequestRecord


@dataclass(frozen=True)
class DriverConfig:
    max_concurrency: int = 64
    duration_s: float | None = None  # None: issue the whole plan and wait for every request
    grace_s: float = 10.0
    request_timeout_s: float = 600.0
    temperature: float = 0.0
    run_tag: str = "bench"
    progress: bool = True

    def __post_init__(self):
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        for flag, value, low_ok in (
            ("--duration-s", self.duration_s, False),
            ("--grace-s", self.grace_s, True),
            ("--request-timeout-s", self.request_timeout_s, False),
        ):
            if value is not None and not ((value >= 0 if low_ok else value > 0) and math.isfinite(value)):
                raise ValueError(f"{flag} must be a finite number {'>=' if low_ok else '>'} 0, got {value}")


@dataclass(frozen=True)
class RunResult:
    records: tuple[RequestRecord, ...]  # issued requests, in plan order
    planned: int
    not_issued: int


class _Run:
    """One execution of a plan: the clock, the slots and the recorders of issued requests."""

    def __init__(self, backend, plan: Plan, config: DriverConfig):
        self.backend, self.plan, self.config = backend, plan, config
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.start = time.monotonic()
        self.recorders: list[RequestRecorder] = []
        self.tasks: list[asyncio.Task] = []
        self.bar = tqdm(total=len(plan.requests), unit="req", disable=not config.progress, leave=False)

    def now_s(self) -> float:
        return time.monotonic() - self.start

    async def issue_all(self) -> None:
        stop_s = self.config.duration_s if self.config.duration_s is not None else math.inf
        for planned in self.plan.requests:
            if planned.arrival_s >= stop_s:
                return
            await asyncio.sleep(max(planned.arrival_s - self.now_s(), 0.0))
            if not await self._take_slot(stop_s - self.now_s()):
                return
            recorder = RequestRecorder(planned, f"{self.config.run_tag}-{planned.index:06d}", self.now_s())
            task = asyncio.create_task(self._one(planned, recorder))
            task.add_done_callback(self._released)
            self.recorders.append(recorder)
            self.tasks.append(task)

    async def _take_slot(self, budget_s: float) -> bool:
        if budget_s <= 0:
            return False
        if math.isinf(budget_s):
            await self.slots.acquire()
            return True
        try:
            await asyncio.wait_for(self.slots.acquire(), budget_s)
            return True
        except TimeoutError:
            return False

    def _released(self, _task: asyncio.Task) -> None:
        self.slots.release()
        self.bar.update(1)

    async def _one(self, planned: PlannedRequest, recorder: RequestRecorder) -> None:
        options = RequestOptions(recorder.request_id, self.config.temperature, self.config.request_timeout_s)
        try:
            async for event in self.backend.stream(planned, options):
                recorder.on_event(event, self.now_s())
            recorder.on_stream_end(self.now_s())
        except RequestError as err:
            recorder.on_error(err.code, err.reason, self.now_s())
        except asyncio.CancelledError:
            recorder.on_error("CANCELLED", "cancelled by the bench after --duration-s plus --grace-s", self.now_s())
            raise
        except Exception as err:  # noqa: BLE001 - a bench keeps going on one bad request; the record says what happened
            recorder.on_error("CLIENT_ERROR", f"{type(err).__name__}: {err}", self.now_s())

    async def finish(self) -> None:
        """Waits for open requests, up to duration + grace when a duration is set; cancels the rest."""
        if not self.tasks:
            return
        timeout_s = None
        if self.config.duration_s is not None:
            timeout_s = max(self.config.duration_s + self.config.grace_s - self.now_s(), 0.0)
        _, pending = await asyncio.wait(self.tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def drive(backend, plan: Plan, config: DriverConfig = DriverConfig()) -> RunResult:
    """Runs the plan against `backend` (entered: `async with`) and returns every issued request's record."""
    run = _Run(backend, plan, config)
    try:
        await run.issue_all()
        await run.finish()
    finally:
        for task in run.tasks:  # only still-open ones notice: when drive() itself is cancelled
            task.cancel()
        run.bar.close()
    end_s = run.now_s()
    records = tuple(r.record(end_s) for r in run.recorders)
    return RunResult(records, len(plan.requests), len(plan.requests) - len(records))
