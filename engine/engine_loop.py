"""Runs an `LLMEngine` on one dedicated thread, so a worker can take calls while it steps.

The engine is not thread-safe; everything that touches it goes through `call(fn)`, which runs
`fn(engine)` on the loop thread between steps and returns a Future. After every step the loop hands
the step's updates to `on_updates` (on the loop thread). While idle it waits for commands, calling
`on_idle` at most every `idle_interval_s` (a tensor-parallel driver sends heartbeats there).

`load` is a snapshot of the engine's queue and pool, refreshed by the loop thread after every step
and command batch: other threads read it without waiting for the engine (a long step must never
make a live worker look hung).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple, TypeVar

from engine.llm_engine import LLMEngine
from engine.speculative.counters import SpecCounters
from engine.step_log import StepLog, StepRecord
from engine.step_updates import SequenceUpdate

T = TypeVar("T")
STALL_WAIT_S = 0.005


class EngineLoad(NamedTuple):
    """The engine's queue and pool as of the loop's last iteration."""

    waiting: int
    running: int
    num_free_blocks: int
    num_blocks: int
    spec: SpecCounters | None = None  # speculative decoding's counters; None when it is off


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_updates: Callable[[list[SequenceUpdate]], None],
        on_idle: Callable[[], None] | None = None,
        idle_interval_s: float = 0.5,
        name: str = "engine-loop",
        on_step: Callable[[StepRecord], None] | None = None,
    ):
        self.engine = engine
        self.step_log = StepLog()
        self._on_step = on_step
        self._on_updates = on_updates
        self._on_idle = on_idle
        self._idle_interval_s = idle_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self.error: BaseException | None = None  # set if a step failed; the loop then stops
        self.step_delay_s = 0.0  # fault injection for tests: sleep before each step
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.load = self._measure_load()

    @property
    def running(self) -> bool:
        """The loop thread is alive and has not failed."""
        return self.error is None and self._thread.is_alive() and not self._stopping.is_set()

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def call(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Run `fn(engine)` on the loop thread; the Future carries its result or exception."""
        future: Future = Future()
        if self.error is not None or self._stopping.is_set():
            future.set_exception(RuntimeError(f"engine loop is not running: {self.error!r}"))
            return future
        self._commands.put((fn, future))
        return future

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)  # wake the loop
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            stalled = False
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished()
                # A step that ran nothing waits for blocks held elsewhere: poll gently, don't spin.
                self._run_commands(block_s=(STALL_WAIT_S if stalled else 0.0) if busy else self._idle_interval_s)
                if self.engine.has_unfinished():
                    if self.step_delay_s:
                        time.sleep(self.step_delay_s)
                    started_s = time.perf_counter()
                    updates = self.engine.step()
                    stalled = self.engine.last_step_shape[1] == 0 and not updates
                    if not stalled:
                        record = self.step_log.append(time.perf_counter() - started_s, *self.engine.last_step_shape)
                        if self._on_step is not None:
                            self._on_step(record)
                    self._on_updates(updates)
                elif self._on_idle is not None and not self._stopping.is_set():
                    self._on_idle()
                self.load = self._measure_load()
        except BaseException as err:  # noqa: BLE001 — a dead loop must say why to every caller
            self.error = err
            self._fail_pending(err)

    def _measure_load(self) -> EngineLoad:
        engine = self.engine
        return EngineLoad(
            len(engine.scheduler.waiting),
            len(engine.scheduler.running),
            engine.kv.num_free_blocks,
            engine.num_blocks,
            engine.spec.counters if engine.spec is not None else None,
        )

    def _run_commands(self, block_s: float) -> None:
        try:
            item = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as err:  # noqa: BLE001 - the caller gets its own error; the loop goes on
                    future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError(f"engine loop failed: {err!r}"))
