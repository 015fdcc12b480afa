"""The decode instance's tensor-parallel group: forming it, and rank 0 driving the other ranks.

Rank 0 is a whole `LLMEngine` (scheduler, block pool, sampler); ranks > 0 hold only their shard of the weights and
of a KV pool of the same block count. Each step rank 0 broadcasts the `StepInput` over the TP group itself, then
every rank runs the same forward. Messages and the forward's all-reduces share the group, so they happen in one
total order on every rank: no second channel, no Ray call per step.

One message = two broadcasts from rank 0: header int64[4] = (MAGIC, sequence number, kind, payload length), then,
unless the length is 0, the payload int64[length] (`encode_step`). Kinds: IDLE (heartbeat), STEP, STOP. Magic and
sequence number turn a follower that got out of step into a loud error instead of a garbled forward.

Liveness: a heartbeat thread on rank 0 sends IDLE whenever nothing went out for `heartbeat_interval_s`; a follower
that hears nothing for `heartbeat_timeout_s` raises. A crashed rank 0 is noticed at once (its sockets close); the
timeout catches a hung or unreachable one. A heartbeat proves rank 0's process is alive, not that its loop makes
progress: that is the supervisor's check. Any `CollectiveError` is fatal to the instance: every rank is torn down
and the group re-formed.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import NamedTuple, Protocol
from urllib.parse import quote

import torch
from torch.distributed import PrefixStore

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_engine_model_config
from engine.model_runner import ModelRunner, StepInput
from engine.parallel import BACKENDS, CollectiveError, TensorParallelGroup, new_process_group
from engine.speculative.draft_model import speculative_draft_config
from engine.step_wire import decode_step, encode_step
from kvtransfer.store import connect_store

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0  # five missed heartbeats: survives a busy 2-core box, still prompt
_MAGIC = 0x5350_5354_4550_0001  # "SPSTEP", wire version 1
_HEADER_LEN = 4


class MessageKind(enum.IntEnum):
    IDLE = 0
    STEP = 1
    STOP = 2


# ---- forming the group ---------------------------------------------------------------------------
def create_tp_group(
    instance_id: str, rank: int, size: int, store_host: str, store_port: int, timeout_s: float, backend: str = "gloo"
) -> TensorParallelGroup:
    """Join instance `instance_id`'s TP group as `rank` of `size`, under `tp/<instance_id>` in the
    launcher's store; never torch.distributed's default group. Waits at most `timeout_s` for all
    ranks; that timeout also bounds every later collective. Every incarnation of an instance needs a
    new id (a rank joining an id twice is refused: the store still holds the dead one's addresses).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown tensor-parallel backend {backend!r}; known: {', '.join(BACKENDS)}")
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
    if size == 1:
        device = "cuda" if backend == "nccl" else "cpu"
        return TensorParallelGroup(0, 1, timeout_s=timeout_s, device=device)
    try:
        store = PrefixStore(f"tp/{quote(instance_id, safe='')}", connect_store(store_host, store_port, timeout_s))
        if int(store.add(f"joined/{rank}", 1)) != 1:
            raise ValueError(
                f"rank {rank} already joined tensor-parallel group {instance_id!r}: "
                "give every incarnation of an instance a new id"
            )
        group, device = new_process_group(backend, store, rank, size, timeout_s)
    except RuntimeError as exc:  # store unreachable, or the other ranks did not join in time
        raise CollectiveError(
            f"could not form tensor-parallel group {instance_id!r} as rank {rank} of {size} "
            f"within {timeout_s:g} s: {str(exc).strip().splitlines()[0][:300]}"
        ) from None
    return TensorParallelGroup(rank, size, group, timeout_s, device)


# ---- StepInput on the wire -----------------------------------------------------------------------
def _ints(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


class StepBroadcaster:
    """Rank 0's sender, with an optional heartbeat thread. Every message goes out under `lock`, and a
    TP driver holds the same lock across a step's broadcast and forward, so a heartbeat never lands
    between a step's all-reduces. A failed send is kept: every later send raises it (the group broke)."""

    def __init__(self, tp: TensorParallelGroup):
        if tp.rank != 0:
            raise ValueError(f"only rank 0 broadcasts steps, this is rank {tp.rank}")
        self.tp = tp
        self.lock = threading.RLock()
        self._sequence = 0
        self.last_step_sequence = -1  # the number of the last STEP sent (what followers number it too)
        self._last_send_s = time.monotonic()
        self._stopped = False
        self._failure: str | None = None
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return not self._stopped and self._failure is None

    def send_step(self, step: StepInput) -> None:
        with self.lock:
            sequence = self._sequence
            self._send(MessageKind.STEP, encode_step(step))
            self.last_step_sequence = sequence

    def send_idle(self) -> None:
        """A heartbeat: tells the followers rank 0 is alive while it has no step for them."""
        self._send(MessageKind.IDLE, None)

    def send_stop(self) -> None:
        """Release the followers (their `run` returns); nothing may be sent afterwards."""
        self.stop_heartbeat()
        self._send(MessageKind.STOP, None)
        self._stopped = True

    def mark_failed(self, reason: str) -> None:
        """The ranks may be out of step now: refuse every later message and close the group, so that
        followers blocked in a collective fail at once instead of after their timeout."""
        with self.lock:
            self._failure = self._failure or reason
            self.tp.close()

    def start_heartbeat(self, interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S) -> None:
        """Send IDLE from a daemon thread whenever nothing was sent for `interval_s`. The thread ends
        on `stop_heartbeat`/`send_stop` or on the first failure (kept: the next step raises it)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        if self.tp.size > 1 and self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, args=(interval_s,), name="tp-heartbeat", daemon=True)
            self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        # No join (a caller holding `lock` could deadlock): the flag is checked under `lock` before each send.
        self._heartbeat_stop.set()

    def _beat(self, interval_s: float) -> None:
        # Polling at a quarter interval keeps every gap between messages under 1.25 intervals.
        while not self._heartbeat_stop.wait(interval_s / 4):
            with self.lock:
                if self._heartbeat_stop.is_set() or not self.is_open:
                    return
                try:
                    if time.monotonic() - self._last_send_s >= interval_s:
                        self.send_idle()
                except CollectiveError:
                    return

    def _send(self, kind: MessageKind, payload: torch.Tensor | None) -> None:
        with self.lock:
            if self._failure is not None:
                raise CollectiveError(f"the tensor-parallel group already failed: {self._failure}")
            if self._stopped:
                raise RuntimeError("the followers were already told to stop")
            if self.tp.size == 1:
                return
            length = 0 if payload is None else payload.numel()
            header = _ints([_MAGIC, self._sequence, kind, length]).to(self.tp.device)
            try:
                self.tp.broadcast(header, 0)
                if payload is not None and length:
                    self.tp.broadcast(payload.to(self.tp.device), 0)
            except CollectiveError as exc:
                self.mark_failed(str(exc))
                raise
            self._sequence += 1
            self._last_send_s = time.monotonic()


class TensorParallelEngine(LLMEngine):
    """Rank 0 of a TP decode instance: an `LLMEngine` whose `execute` first sends the step to the other
    ranks, then runs this rank's shard of the forward. Heartbeats start once the weights are loaded;
    `shutdown()` releases the followers."""

    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallelGroup,
        *,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        progress: bool = False,
        on_kv_event=None,
    ):
        _check_tp_size(config, tp)
        self.broadcaster = StepBroadcaster(tp)
        self.last_step: tuple[int, StepInput] | None = None  # (its sequence number, the step): the KV it wrote
        super().__init__(config, tp=tp, progress=progress, on_kv_event=on_kv_event)
        self.broadcaster.start_heartbeat(heartbeat_interval_s)

    def execute(self, step_input: StepInput) -> torch.Tensor:
        with self.broadcaster.lock:
            self.broadcaster.send_step(step_input)
            self.last_step = (self.broadcaster.last_step_sequence, step_input)
            try:
                return self.runner.execute(step_input)
            except BaseException as exc:  # even a local error leaves the followers mid-step
                self.broadcaster.mark_failed(f"rank 0's forward failed: {exc!r}")
                raise

    def shutdown(self) -> None:
        """Stop heartbeats and release the followers (unless the group already failed); idempotent."""
        self.broadcaster.stop_heartbeat()
        if self.broadcaster.is_open:
            self.broadcaster.send_stop()


# ---- ranks > 0 -----------------------------------------------------------------------------------
def _check_tp_size(config: EngineConfig, tp: TensorParallelGroup) -> None:
    # tp_size sizes the KV pool per rank: a mismatch would give the ranks different block counts.
    if config.tp_size != tp.size:
        raise ValueError(f"EngineConfig.tp_size={config.tp_size} but the tensor-parallel group has {tp.size} ranks")


def build_follower_runner(config: EngineConfig, tp: TensorParallelGroup, progress: bool = False) -> ModelRunner:
    """This rank's weight shard and KV cache, sized exactly as rank 0's `LLMEngine` sizes its own."""
    _check_tp_size(config, tp)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_config = load_engine_model_config(config)
    # A draft model (speculative decoding) runs on rank 0 only, but its KV shares rank 0's block budget.
    num_blocks = config.num_blocks_for(model_config, speculative_draft_config(config, model_config))
    return ModelRunner(config, model_config, config.max_len_for(model_config), num_blocks, tp, progress)


class FollowerStats(NamedTuple):
    num_steps: int
    num_heartbeats: int


class StepObserver(Protocol):
    """Told about each step a follower runs, by its number in the group's message sequence."""

    def before_forward(self, sequence: int, step: StepInput) -> None: ...

    def after_forward(self, sequence: int) -> None: ...


class StepFollower:
    """A rank > 0: receives rank 0's messages and runs each step's forward on its own `ModelRunner`.

    `startup_timeout_s` (default: the group's timeout) bounds the wait for the first message, while
    rank 0 may still be loading its weights; `heartbeat_timeout_s` bounds every later wait.
    """

    def __init__(
        self,
        tp: TensorParallelGroup,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        startup_timeout_s: float | None = None,
    ):
        if tp.rank == 0:
            raise ValueError("rank 0 drives the group; followers are ranks > 0")
        self.tp = tp
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._startup_timeout_s = tp.timeout_s if startup_timeout_s is None else startup_timeout_s
        self._sequence = 0

    def run(
        self, runner: ModelRunner, stop_event: threading.Event | None = None, observer: StepObserver | None = None
    ) -> FollowerStats:
        """Follow until rank 0 sends STOP (or `stop_event` is set, checked between messages); `observer`
        hears of each step around its forward.

        Raises `CollectiveError` when rank 0 dies, hangs past the timeout, or breaks the protocol;
        any failure closes the group.
        """
        steps = heartbeats = 0
        timeout_s = self._startup_timeout_s
        try:
            while stop_event is None or not stop_event.is_set():
                kind, payload = self._receive(timeout_s)
                timeout_s = self._heartbeat_timeout_s
                if kind is MessageKind.STOP:
                    break
                heartbeats += kind is MessageKind.IDLE
                if kind is MessageKind.STEP:
                    assert payload is not None, "a STEP message carries the step's inputs"
                    step = decode_step(payload)
                    if observer is not None:
                        observer.before_forward(self._sequence - 1, step)
                    runner.forward(step)
                    if observer is not None:
                        observer.after_forward(self._sequence - 1)
                    steps += 1
        except BaseException:
            self.tp.close()  # the group is out of step: let rank 0 notice now, not after its timeout
            raise
        return FollowerStats(steps, heartbeats)

    def _receive(self, timeout_s: float) -> tuple[MessageKind, torch.Tensor | None]:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.tp.device)
        try:
            self.tp.broadcast(header, 0, timeout_s)
        except CollectiveError as exc:
            why = (
                f"heard nothing (no step, no heartbeat) for {timeout_s:g} s: rank 0 is hung or unreachable"
                if "timed out" in str(exc).lower()
                else "the connection to rank 0 failed: it probably crashed"
            )
            raise CollectiveError(
                f"rank {self.tp.rank} lost rank 0 after message {self._sequence}: {why} ({exc})"
            ) from None
        magic, sequence, kind, length = header.tolist()
        if magic != _MAGIC or sequence != self._sequence or kind not in tuple(MessageKind):
            raise CollectiveError(
                f"rank {self.tp.rank}: protocol violated: header {[magic, sequence, kind, length]},"
                f" expected magic {_MAGIC:#x} and message {self._sequence}"
            )
        self._sequence += 1
        if not length:
            return MessageKind(kind), None
        payload = torch.empty(length, dtype=torch.int64, device=self.tp.device)
        return MessageKind(kind), self.tp.broadcast(payload, 0)
