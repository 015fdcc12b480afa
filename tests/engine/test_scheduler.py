"""The scheduler's decisions, exactly: token budget, chunking, admission order, preemption victims.
No model runs here; chunks are 'computed' by advancing the counters as the engine would."""
from __future__ import annotations

from engine.block_hash import HashNamespace
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus

NAMESPACE = HashNamespace("test-model", 4)


def _seq(name: str, num_tokens: int, order: int, priority: int = 0) -> Sequence:
    return Sequence(seq_id=name, token_ids=list(range(1, num_tokens + 1)), num_prompt_tokens=num_tokens,
                    params=SamplingParams(max_tokens=100), hash_namespace=NAMESPACE, arrival_time_s=0.0,
                    arrival_order=order, priority=priority)


def _scheduler(num_blocks=32, budget=16, chunk=8, max_seqs=8, caching=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunk), kv)


def _run(out) -> list[tuple[str, int, int]]:
    """Advance counters like the engine does; append a token to sequences that sampled."""
    plan = [(c.seq.seq_id, c.start, c.num_new_tokens) for c in out.chunks]
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens = chunk.start + chunk.num_new_tokens
        if chunk.samples:
            chunk.seq.token_ids.append(7)
    return plan


def test_chunks_respect_chunk_size_and_token_budget():
    sched = _scheduler(budget=16, chunk=8)
    a, b, c = _seq("a", 20, 0), _seq("b", 5, 1), _seq("c", 9, 2)
    for seq in (a, b, c):
        sched.add(seq)
    assert _run(sched.schedule()) == [("a", 0, 8), ("b", 0, 5), ("c", 0, 3)]
    assert _run(sched.schedule()) == [("a", 8, 8), ("b", 5, 1), ("c", 3, 6)]  # b decodes
    assert _run(sched.schedule()) == [("a", 16, 4), ("b", 6, 1), ("c", 9, 1)]
    assert _run(sched.schedule()) == [("a", 20, 1), ("b", 7, 1), ("c", 10, 1)]


def test_max_num_seqs_caps_the_running_batch():
    sched = _scheduler(max_seqs=2)
    for index in range(3):
        sched.add(_seq(f"s{index}", 4, index))
    assert [seq_id for seq_id, _, _ in _run(sched.schedule())] == ["s0", "s1"]
    assert [s.seq_id for s in sched.waiting] == ["s2"]


def test_waiting_order_is_priority_then_arrival():
    sched = _scheduler(max_seqs=1)
    for name, order, priority in [("a", 0, 0), ("b", 1, 3), ("c", 2, 0), ("d", 3, 3)]:
        sched.add(_seq(name, 4, order, priority))
    assert [s.seq_id for s in sched.waiting] == ["b", "d", "a", "c"]


def test_preemption_takes_the_least_important_latest_arrival():
    # 6 blocks of 4 tokens: three 8-token prompts take all of them; growing needs a victim.
    sched = _scheduler(num_blocks=6, budget=64, chunk=64)
    seqs = [_seq("old", 8, 0), _seq("vip", 8, 2, priority=1), _seq("new", 8, 1)]
    for seq in seqs:
        sched.add(seq)
    assert [p[0] for p in _run(sched.schedule())] == ["vip", "old", "new"]
    out = sched.schedule()  # each needs a third block for its 9th token: only two of three fit
    assert [s.seq_id for s in out.preempted] == ["new"]
    assert [p[0] for p in _run(out)] == ["vip", "old"]
    new = seqs[2]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.num_preemptions == 1
    assert sched.kv.num_free_blocks == 0
    sched.kv.check_integrity()


def test_a_sequence_that_cannot_grow_preempts_itself_last():
    sched = _scheduler(num_blocks=2, budget=64, chunk=64)
    seq = _seq("only", 8, 0)
    sched.add(seq)
    _run(sched.schedule())
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["only"] and out.chunks == ()
    assert sched.kv.num_free_blocks == 2


def test_no_admission_in_a_step_that_preempted():
    sched = _scheduler(num_blocks=4, budget=64, chunk=64)
    sched.add(_seq("a", 8, 0))
    sched.add(_seq("b", 8, 1))
    _run(sched.schedule())
    sched.add(_seq("c", 2, 2))
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["b"]
    assert all(c.seq.seq_id != "c" for c in out.chunks)


def test_admission_starts_after_the_cached_prefix():
    sched = _scheduler(caching=True, budget=64, chunk=64)
    first = _seq("first", 10, 0)
    sched.add(first)
    _run(sched.schedule())
    sched.kv.cache_blocks("first", first.token_ids, first.refresh_block_hashes(), first.num_computed_tokens)
    twin = _seq("twin", 10, 1)
    sched.add(twin)
    plan = _run(sched.schedule())
    assert ("twin", 8, 2) in plan  # two full blocks of 4 cached; the last two tokens computed
    assert twin.num_cached_tokens == 8


def test_lookahead_slots_for_decoding_sequences_only_and_never_at_the_price_of_a_preemption():
    sched = _scheduler(num_blocks=7, budget=32, chunk=16)
    a, b = _seq("a", 3, 0), _seq("b", 9, 1)
    for seq in (a, b):
        sched.add(seq)
    first = sched.schedule(num_lookahead_tokens=4)
    assert [c.num_lookahead_slots for c in first.chunks] == [0, 0]  # both still prefilling
    _run(first)
    second = sched.schedule(num_lookahead_tokens=4)  # a: 4 tokens in 1 block, b: 10 in 3, 3 blocks free
    assert [(c.seq.seq_id, c.num_new_tokens, c.num_lookahead_slots) for c in second.chunks] == [
        ("a", 1, 4), ("b", 1, 0)]  # a's slots take 1 block (2 left for 2 sequences); b's would leave 1
    assert len(sched.kv.block_table("a")) == 2 and not second.preempted
    sched.kv.check_integrity()
