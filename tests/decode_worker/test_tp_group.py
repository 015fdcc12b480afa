"""The decode instance's tensor-parallel group over real processes: greedy tokens equal HF's at TP=2
(GQA, MQA) and TP=4 with chunked prefill, all-reduce sums exactly, and a follower whose rank 0 dies or
hangs fails with a clear error within its timeout; plus the step codec and the argument checks.

Ranks run in long-lived spawned agents (a process importing torch costs seconds on 2 cores); every
group gets a fresh instance id. `tests.factories` (transformers, ~5 s to import) is imported inside
the tests only: agents import this module to find their jobs and never need it.
"""
from __future__ import annotations

import datetime
import itertools
import multiprocessing
import os
import signal
import time

import pytest
import torch
from torch.distributed import PrefixStore

from decode_worker.tp_group import (StepBroadcaster, StepFollower, TensorParallelEngine, build_follower_runner,
                                    create_tp_group, decode_step, encode_step)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import StepInput
from engine.parallel import SINGLE_RANK, CollectiveError
from engine.sampling_params import SamplingParams
from kvtransfer.store import connect_store

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds this interface; the sandbox has only lo
HOST = "127.0.0.1"
GROUP_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 120.0  # how long a test waits for an agent before declaring it hung
MAX_TOKENS = 8
_SPAWN = multiprocessing.get_context("spawn")
_instance_ids = itertools.count()


# ---- agents: worker processes that run one job at a time -------------------------------------------
def _agent_main(conn) -> None:
    torch.set_num_threads(1)  # several ranks' OpenMP pools spinning on 2 cores starve gloo's IO threads
    while (job := conn.recv()) is not None:
        fn, kwargs = job
        try:
            reply = ("ok", fn(**kwargs))
        except Exception as exc:  # reported to the test, which asserts on type and text
            reply = ("error", type(exc).__name__, str(exc))
        conn.send(reply)


class Agent:
    """One worker process; every wait on it is bounded."""

    def __init__(self):
        self._conn, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_agent_main, args=(child,), daemon=True)
        self.process.start()

    def submit(self, fn, **kwargs) -> None:
        self._conn.send((fn, kwargs))

    def has_result(self) -> bool:
        return self._conn.poll(0)

    def result(self, timeout_s: float = REPLY_TIMEOUT_S):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"agent pid {self.process.pid} gave no answer within {timeout_s} s (hung?)")
        return self._conn.recv()

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def ask_to_exit(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass

    def stop(self) -> None:
        self.ask_to_exit()
        self.process.join(5)
        if self.process.is_alive():
            self.kill()


class Agents:
    def __init__(self, count: int):
        self._agents = [Agent() for _ in range(count)]

    def take(self, count: int) -> list[Agent]:
        """`count` live agents; ones a fault test killed are replaced."""
        self._agents = [agent if agent.process.is_alive() else Agent() for agent in self._agents]
        return self._agents[:count]

    def stop(self) -> None:
        for agent in self._agents:  # all at once: each takes a moment to exit
            agent.ask_to_exit()
        for agent in self._agents:
            agent.stop()


# ---- jobs (run inside agents) ----------------------------------------------------------------------
def _engine_config(model_dir: str, tp_size: int) -> EngineConfig:
    # Small chunk and batch budgets: prompts span several chunks and steps mix decode and prefill rows.
    return EngineConfig(model_dir=model_dir, block_size=4, num_kv_blocks=128, max_num_seqs=4,
                        max_num_batched_tokens=16, prefill_chunk_tokens=7, max_model_len=96, num_threads=1,
                        tp_size=tp_size)


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seq_ids = [f"req-{index}" for index in range(len(prompts))]
    for seq_id, prompt in zip(seq_ids, prompts):
        engine.add_request(seq_id, prompt, params)
    for _ in range(10_000):
        if not engine.has_unfinished():
            return [list(engine.pop_finished(seq_id).output_token_ids) for seq_id in seq_ids]
        engine.step()
    raise RuntimeError("generation did not finish in 10000 steps")


class _CountingEngine(TensorParallelEngine):
    num_steps = 0

    def execute(self, step_input: StepInput) -> torch.Tensor:
        self.num_steps += 1
        return super().execute(step_input)


def _job_rank0(instance: str, size: int, port: int, model_dir: str, prompts: list, max_tokens: int) -> dict:
    tp = create_tp_group(instance, 0, size, HOST, port, GROUP_TIMEOUT_S)
    engine = _CountingEngine(_engine_config(model_dir, size), tp)
    try:
        return {"tokens": _generate(engine, prompts, max_tokens), "num_steps": engine.num_steps}
    finally:
        engine.shutdown()
        tp.close()


def _job_follower(instance: str, rank: int, size: int, port: int, model_dir: str,
                  heartbeat_timeout_s: float = 5.0) -> dict:
    tp = create_tp_group(instance, rank, size, HOST, port, GROUP_TIMEOUT_S)
    try:
        runner = build_follower_runner(_engine_config(model_dir, size), tp)
        return StepFollower(tp, heartbeat_timeout_s=heartbeat_timeout_s).run(runner)._asdict()
    finally:
        tp.close()


def _job_rank0_failing_forward(instance: str, port: int, model_dir: str, prompts: list, fail_at_step: int) -> str:
    """Rank 0 whose own forward raises (a local bug, not a collective) at step `fail_at_step`."""
    tp = create_tp_group(instance, 0, 2, HOST, port, GROUP_TIMEOUT_S)
    engine = TensorParallelEngine(_engine_config(model_dir, 2), tp)
    real_execute, calls = engine.runner.execute, itertools.count(1)

    def execute(step: StepInput) -> torch.Tensor:
        if next(calls) == fail_at_step:
            raise RuntimeError("injected forward failure")
        return real_execute(step)

    engine.runner.execute = execute
    with pytest.raises(RuntimeError, match="injected"):
        _generate(engine, prompts, 4)
    with pytest.raises(CollectiveError, match="already failed"):
        engine.step()  # the group is gone: nothing more reaches the followers
    return "ok"


def _job_heartbeat_forever(instance: str, port: int, interval_s: float) -> None:
    """Rank 0 of a 2-rank group that only heartbeats, until the test kills or stops it."""
    tp = create_tp_group(instance, 0, 2, HOST, port, GROUP_TIMEOUT_S)
    broadcaster = StepBroadcaster(tp)
    broadcaster.send_idle()  # completes once the follower listens
    connect_store(HOST, port).set(f"ready/{instance}", "1")
    broadcaster.start_heartbeat(interval_s)
    time.sleep(REPLY_TIMEOUT_S)


def _job_collectives(instance: str, rank: int, size: int, port: int) -> tuple:
    tp = create_tp_group(instance, rank, size, HOST, port, GROUP_TIMEOUT_S)
    try:
        floats = _float_values(rank)
        ints = torch.tensor([2**40, -7, 0], dtype=torch.int64) * (rank + 1)
        strided = torch.full((3, 2), float(rank + 1))[:, 0]  # a non-contiguous view
        for tensor in (floats, ints, strided):
            tp.all_reduce(tensor)
        message = tp.broadcast(torch.full((3,), rank, dtype=torch.int64), src_rank=0)
        return floats.tolist(), ints.tolist(), strided.tolist(), message.tolist()
    finally:
        tp.close()


def _float_values(rank: int) -> torch.Tensor:
    return torch.tensor([0.1, 1e8, -3.5, 2.0**-20, 1 / 3], dtype=torch.float32) * (rank + 1)


# ---- helpers on the test side -----------------------------------------------------------------------
def _new_instance() -> str:
    return f"test-{os.getpid()}-{next(_instance_ids)}"


def _start_instance(ranks: list[Agent], port: int, model_dir, prompts: list, max_tokens: int = MAX_TOKENS) -> None:
    instance, size = _new_instance(), len(ranks)
    ranks[0].submit(_job_rank0, instance=instance, size=size, port=port, model_dir=str(model_dir),
                    prompts=prompts, max_tokens=max_tokens)
    for rank, agent in enumerate(ranks[1:], start=1):
        agent.submit(_job_follower, instance=instance, rank=rank, size=size, port=port, model_dir=str(model_dir))


def _finish_instance(ranks: list[Agent]) -> list[list[int]]:
    replies = [agent.result() for agent in ranks]
    assert all(reply[0] == "ok" for reply in replies), replies
    leader, followers = replies[0][1], [reply[1] for reply in replies[1:]]
    assert [f["num_steps"] for f in followers] == [leader["num_steps"]] * len(followers)
    return leader["tokens"]


# ---- tests over real processes ------------------------------------------------------------------------
def test_all_reduce_sums_exactly_across_two_ranks(agents, rendezvous):
    instance = _new_instance()
    ranks = agents.take(2)
    for rank, agent in enumerate(ranks):
        agent.submit(_job_collectives, instance=instance, rank=rank, size=2, port=rendezvous.port)
    replies = [agent.result() for agent in ranks]
    assert all(reply[0] == "ok" for reply in replies), replies
    expected = ((_float_values(0) + _float_values(1)).tolist(), [3 * 2**40, -21, 0], [3.0, 3.0, 3.0], [0, 0, 0])
    assert replies[0][1] == replies[1][1] == expected


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa-replicated-kv"])
def test_tp2_greedy_tokens_match_hf_with_chunked_prefill(num_kv_heads, checkpoint, agents, rendezvous):
    from tests.factories import TinySpec, hf_greedy_generate, random_prompts

    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=num_kv_heads))
    prompts = random_prompts(5, 2, 30, 512, seed=17)
    ranks = agents.take(2)
    _start_instance(ranks, rendezvous.port, model_dir, prompts)
    expected = hf_greedy_generate(model_dir, prompts, MAX_TOKENS)  # overlaps with the ranks' work
    assert _finish_instance(ranks) == expected


def test_tp4_greedy_tokens_match_hf(checkpoint, agents, rendezvous):
    from tests.factories import TinySpec, hf_greedy_generate, random_prompts

    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=2))  # 2 KV heads on 4 ranks: replicated
    prompts = random_prompts(3, 3, 20, 512, seed=18)
    ranks = agents.take(4)
    _start_instance(ranks, rendezvous.port, model_dir, prompts, max_tokens=6)
    expected = hf_greedy_generate(model_dir, prompts, 6)
    assert _finish_instance(ranks) == expected


def _start_heartbeat_pair(agents, rendezvous, model_dir, heartbeat_timeout_s: float) -> tuple[Agent, Agent]:
    instance = _new_instance()
    rank0, follower = agents.take(2)
    rank0.submit(_job_heartbeat_forever, instance=instance, port=rendezvous.port, interval_s=0.1)
    follower.submit(_job_follower, instance=instance, rank=1, size=2, port=rendezvous.port,
                    model_dir=str(model_dir), heartbeat_timeout_s=heartbeat_timeout_s)
    rendezvous.store.wait([f"ready/{instance}"], datetime.timedelta(seconds=REPLY_TIMEOUT_S))
    return rank0, follower


def test_follower_fails_fast_when_rank0_is_killed(checkpoint, agents, rendezvous):
    from tests.factories import TinySpec

    rank0, follower = _start_heartbeat_pair(agents, rendezvous, checkpoint(TinySpec()), heartbeat_timeout_s=5.0)
    start_s = time.monotonic()
    rank0.kill()
    reply = follower.result(timeout_s=15.0)
    elapsed_s = time.monotonic() - start_s
    assert reply[:2] == ("error", "CollectiveError"), reply
    assert "rank 1 lost rank 0" in reply[2] and "crashed" in reply[2]
    assert elapsed_s < 4.0  # noticed through the closed connection, not the 5 s heartbeat timeout


def test_follower_times_out_when_rank0_hangs_but_survives_idle_on_heartbeats(checkpoint, agents, rendezvous):
    from tests.factories import TinySpec

    rank0, follower = _start_heartbeat_pair(agents, rendezvous, checkpoint(TinySpec()), heartbeat_timeout_s=1.0)
    try:
        time.sleep(2.0)  # twice the follower's timeout with no step: heartbeats alone keep it following
        assert not follower.has_result()
        rank0.signal(signal.SIGSTOP)  # alive but silent: sockets stay open, only the timeout can tell
        start_s = time.monotonic()
        reply = follower.result(timeout_s=15.0)
        elapsed_s = time.monotonic() - start_s
    finally:
        rank0.kill()
    assert reply[:2] == ("error", "CollectiveError"), reply
    assert "heard nothing" in reply[2] and "hung or unreachable" in reply[2]
    assert 0.5 <= elapsed_s < 4.0


def test_rank0_forward_error_closes_the_group_so_followers_fail_fast(checkpoint, agents, rendezvous):
    from tests.factories import TinySpec, random_prompts

    model_dir, instance = str(checkpoint(TinySpec())), _new_instance()
    rank0, follower = agents.take(2)
    rank0.submit(_job_rank0_failing_forward, instance=instance, port=rendezvous.port, model_dir=model_dir,
                 prompts=random_prompts(2, 5, 9, 512, seed=3), fail_at_step=3)
    follower.submit(_job_follower, instance=instance, rank=1, size=2, port=rendezvous.port, model_dir=model_dir)
    assert rank0.result() == ("ok", "ok")
    start_s = time.monotonic()
    reply = follower.result(timeout_s=GROUP_TIMEOUT_S)
    assert reply[:2] == ("error", "CollectiveError"), reply
    assert "all_reduce failed on rank 1" in reply[2]  # stuck in step 3's first all-reduce
    assert time.monotonic() - start_s < 10.0  # not the group's 30 s timeout


# ---- in-process tests -------------------------------------------------------------------------------
class _RecordingEngine(LLMEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[StepInput] = []

    def execute(self, step_input: StepInput) -> torch.Tensor:
        self.steps.append(step_input)
        return super().execute(step_input)


def _assert_same_step(got: StepInput, want: StepInput) -> None:
    for name, value in vars(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and other.shape == value.shape and torch.equal(other, value), name
        elif isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
            assert len(other) == len(value) and all(torch.equal(a, b) for a, b in zip(other, value)), name
        else:
            assert other == value and type(other) is type(value), name


def test_step_codec_round_trips_every_step_of_a_real_run_exactly(checkpoint):
    from tests.factories import TinySpec, random_prompts

    engine = _RecordingEngine(_engine_config(str(checkpoint(TinySpec())), 1))
    _generate(engine, random_prompts(5, 2, 30, 512, seed=19), 4)
    kinds = {(step.num_decode_tokens > 0, len(step.prefill_query_lens) > 0) for step in engine.steps}
    assert kinds == {(False, True), (True, True), (True, False)}  # prefill-only, mixed, decode-only
    for step in engine.steps:
        message = encode_step(step)
        assert message.dtype == torch.int64 and message.dim() == 1
        _assert_same_step(decode_step(message), step)


def test_step_codec_refuses_malformed_messages():
    step = StepInput(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([8, 9]), 0,
                     torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), (2,), (2,),
                     (torch.tensor([2]),), torch.tensor([1]))
    message = encode_step(step)
    with pytest.raises(ValueError, match="malformed"):
        decode_step(message[:-1])
    with pytest.raises(ValueError, match="malformed"):
        decode_step(torch.cat([message, torch.tensor([0])]))
    with pytest.raises(TypeError, match="int64"):
        encode_step(StepInput(**{**vars(step), "positions": torch.tensor([0, 1], dtype=torch.int32)}))


def test_group_arguments_are_checked_and_size_one_needs_no_store():
    single = create_tp_group("solo", 0, 1, HOST, 1, timeout_s=1.0)  # port 1: nothing listens there
    assert (single.rank, single.size) == (0, 1)
    assert torch.equal(single.all_reduce(torch.ones(2)), torch.ones(2))
    with pytest.raises(ValueError, match="known: gloo, nccl"):
        create_tp_group("x", 0, 2, HOST, 1, 1.0, backend="mpi")
    with pytest.raises(ValueError, match="outside"):
        create_tp_group("x", 2, 2, HOST, 1, 1.0)
    with pytest.raises(ValueError, match="followers are ranks > 0"):
        StepFollower(single)


def test_forming_a_group_is_bounded_and_an_instance_id_is_single_use(rendezvous):
    instance = _new_instance()
    start_s = time.monotonic()
    with pytest.raises(CollectiveError, match="could not form tensor-parallel group"):
        create_tp_group(instance, 0, 2, HOST, rendezvous.port, timeout_s=1.0)  # rank 1 never comes
    assert time.monotonic() - start_s < 10.0
    with pytest.raises(ValueError, match="already joined"):
        create_tp_group(instance, 0, 2, HOST, rendezvous.port, timeout_s=1.0)
    assert int(PrefixStore(f"tp/{instance}", rendezvous.store).add("joined/1", 0)) == 0


def test_tensor_parallel_engine_needs_matching_tp_size_and_runs_alone(checkpoint):
    from tests.factories import TinySpec, hf_greedy_generate, random_prompts

    model_dir = checkpoint(TinySpec())
    with pytest.raises(ValueError, match="tp_size=2"):
        TensorParallelEngine(_engine_config(str(model_dir), 2), SINGLE_RANK)
    engine = TensorParallelEngine(_engine_config(str(model_dir), 1), SINGLE_RANK)
    prompts = random_prompts(2, 3, 12, 512, seed=20)
    assert _generate(engine, prompts, 4) == hf_greedy_generate(model_dir, prompts, 4)
    engine.shutdown()
    engine.shutdown()  # idempotent
