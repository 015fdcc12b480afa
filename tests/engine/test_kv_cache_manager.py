"""KVCacheManager: block tables, prefix hits verified by tokens, capacity questions, integrity."""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_hash import HashNamespace, extend_block_hashes, hash_blocks
from engine.block_pool import BlockRemoved, BlockStored, IntegrityError, NoFreeBlocksError
from engine.kv_cache_manager import EMPTY_PREFIX, CachedPrefix, KVCacheManager

BLOCK_SIZE = 4
NS = HashNamespace("test-model@v1", BLOCK_SIZE)


def make(num_blocks=10, **kwargs):
    events = []
    return KVCacheManager(num_blocks, BLOCK_SIZE, on_event=events.append, **kwargs), events


def run_prompt(mgr, seq_id, tokens):
    """Admit a prompt the way the scheduler does, compute all of it, register its full blocks."""
    hashes = hash_blocks(NS, tokens)
    cached = mgr.find_cached_prefix(tokens, hashes)
    assert mgr.can_allocate(seq_id, len(tokens), cached)
    table = mgr.allocate(seq_id, len(tokens), cached)
    mgr.cache_blocks(seq_id, tokens, hashes, len(tokens))
    return cached, table


def test_allocation_order_and_growth():
    mgr, _ = make()
    assert mgr.allocate("a", 10) == (0, 1, 2)
    assert mgr.allocate("b", 4) == (3,)
    assert mgr.allocate("a", 13) == (0, 1, 2, 4)
    assert mgr.allocate("a", 12) == (0, 1, 2, 4)  # never shrinks
    assert mgr.block_table("a") == (0, 1, 2, 4)
    assert mgr.num_free_blocks == 5 and mgr.usage == 0.5
    assert mgr.has("a") and not mgr.has("c")
    mgr.check_integrity()


def test_zero_token_reservation_registers_the_sequence():
    mgr, _ = make()
    assert mgr.allocate("d", 0) == ()
    assert mgr.has("d") and mgr.num_free_blocks == 10
    assert mgr.allocate("d", 5) == (0, 1)
    mgr.check_integrity()


def test_lru_eviction_takes_tail_blocks_of_freed_sequences_first():
    mgr, events = make()
    run_prompt(mgr, "a", list(range(12)))        # blocks 0, 1, 2, all cached
    run_prompt(mgr, "b", list(range(100, 108)))  # blocks 3, 4, both cached
    a_hashes, b_hashes = hash_blocks(NS, list(range(12))), hash_blocks(NS, list(range(100, 108)))
    mgr.free("a")
    mgr.free("b")
    events.clear()
    assert mgr.allocate("c", 36) == (5, 6, 7, 8, 9, 2, 1, 0, 4)
    assert events == [BlockRemoved((a_hashes[2], a_hashes[1], a_hashes[0], b_hashes[1]))]
    # Only b's first block survived eviction, and it is still a hit.
    assert mgr.find_cached_prefix(list(range(100, 109)), b_hashes).block_ids == (3,)
    mgr.check_integrity()


def test_prefix_hit_revives_a_free_cached_block():
    mgr, _ = make()
    run_prompt(mgr, "a", list(range(10)))  # blocks 0, 1 full and cached; block 2 partial
    mgr.free("a")
    assert mgr.num_free_blocks == 10
    prompt = list(range(8)) + [50, 51, 52]
    cached = mgr.find_cached_prefix(prompt, hash_blocks(NS, prompt))
    assert cached == CachedPrefix((0, 1), 8)
    assert mgr.allocate("b", len(prompt), cached) == (0, 1, 3)  # free queue was 3..9, 2, 1, 0
    assert mgr.num_free_blocks == 7
    assert mgr.allocate("c", 4) == (4,)  # the revived blocks left the free queue
    mgr.check_integrity()


def test_hit_at_the_head_of_the_free_queue_is_acquired_before_allocating():
    mgr, events = make(num_blocks=4)
    run_prompt(mgr, "a", [1, 2, 3, 4, 5])  # blocks 0 (cached) and 1
    mgr.free("a")                           # free queue: 2, 3, 1, 0
    mgr.allocate("b", 8)                    # takes 2, 3
    mgr.allocate("c", 4)                    # takes 1; block 0 alone is free
    mgr.free("b")                           # free queue: 0, 3, 2 -- the hit is next in line for eviction
    prompt = [1, 2, 3, 4, 6]
    cached = mgr.find_cached_prefix(prompt, hash_blocks(NS, prompt))
    assert cached == CachedPrefix((0,), 4)
    assert mgr.allocate("d", 5, cached) == (0, 3)
    assert not any(isinstance(e, BlockRemoved) for e in events)
    mgr.check_integrity()


def test_hit_requires_token_equality():
    mgr, _ = make()
    real, forged = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    # Register block 0 holding `real` under the hash of `forged`: a collision, as far as the pool knows.
    mgr.allocate("a", len(real))
    mgr.cache_blocks("a", real, hash_blocks(NS, forged), len(real))
    assert mgr.find_cached_prefix(forged, hash_blocks(NS, forged)) == EMPTY_PREFIX
    assert mgr.find_cached_prefix(real, hash_blocks(NS, forged)) == CachedPrefix((0,), 4)
    mgr.check_integrity()


def test_prompt_of_exactly_n_full_blocks_hits_n_minus_one():
    mgr, _ = make()
    tokens = list(range(12))
    run_prompt(mgr, "a", tokens)
    assert mgr.find_cached_prefix(tokens, hash_blocks(NS, tokens)) == CachedPrefix((0, 1), 8)
    longer = tokens + [99]
    assert mgr.find_cached_prefix(longer, hash_blocks(NS, longer)) == CachedPrefix((0, 1, 2), 12)
    assert mgr.find_cached_prefix(tokens[:4], hash_blocks(NS, tokens[:4])) == EMPTY_PREFIX
    assert mgr.find_cached_prefix([], []) == EMPTY_PREFIX
    mgr.check_integrity()


def test_prompt_ending_mid_block():
    mgr, _ = make()
    run_prompt(mgr, "a", list(range(12)))
    assert mgr.find_cached_prefix(list(range(10)), hash_blocks(NS, range(10))) == CachedPrefix((0, 1), 8)
    assert mgr.find_cached_prefix(list(range(7)), hash_blocks(NS, range(7))) == CachedPrefix((0,), 4)
    diverging = list(range(6)) + [77, 78, 79]  # diverges inside block 1
    assert mgr.find_cached_prefix(diverging, hash_blocks(NS, diverging)) == CachedPrefix((0,), 4)


def test_shared_blocks_have_ref_two_and_survive_freeing_one():
    mgr, _ = make()
    run_prompt(mgr, "a", list(range(10)))
    cached, table = run_prompt(mgr, "b", list(range(8)) + [60, 61])
    assert cached == CachedPrefix((0, 1), 8) and table == (0, 1, 3)
    assert [mgr._pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    mgr.check_integrity()
    mgr.free("a")
    assert [mgr._pool.ref_count(b) for b in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert mgr.block_table("b") == (0, 1, 3)
    assert mgr.num_free_blocks == 7
    mgr.check_integrity()


def test_can_allocate_counts_revived_blocks_against_free_capacity():
    mgr, _ = make(num_blocks=4)
    run_prompt(mgr, "a", list(range(12)))
    mgr.free("a")
    assert mgr.num_free_blocks == 4  # all evictable, all cached
    prompt = list(range(8)) + [40] * 12
    cached = mgr.find_cached_prefix(prompt, hash_blocks(NS, prompt))
    assert cached == CachedPrefix((0, 1), 8)
    # 5 blocks: 2 revived + 3 new = 5 taken from a queue of 4, even though 4 blocks are "evictable".
    assert not mgr.can_allocate("b", 20, cached)
    with pytest.raises(NoFreeBlocksError, match="needs 5 blocks, 4 free"):
        mgr.allocate("b", 20, cached)
    assert not mgr.has("b") and mgr.num_free_blocks == 4
    assert mgr.can_allocate("b", 16, cached)
    assert mgr.allocate("b", 16, cached) == (0, 1, 3, 2)  # hits acquired first, so never evicted
    assert not mgr.can_allocate("b", 17)
    mgr.check_integrity()


def test_can_allocate_is_exact_for_follow_up_prompts():
    # Exhaustive over a small grid: a conversation's first turn is cached and freed, another sequence
    # takes `held` blocks (evicting the first turn's tail blocks once the never-used ones run out), and
    # a follow-up prompt extends the first turn. Every hit is a free block, so the follow-up needs as
    # many free blocks as its table has, hits or not.
    for first_blocks, held, extra in itertools.product(range(1, 6), range(9), range(1, 10)):
        mgr, _ = make(num_blocks=8)
        first = list(range(first_blocks * BLOCK_SIZE))
        run_prompt(mgr, "first", first)
        mgr.free("first")
        mgr.allocate("other", held * BLOCK_SIZE)
        follow_up = first + [999] * extra
        cached = mgr.find_cached_prefix(follow_up, hash_blocks(NS, follow_up))
        survivors = first_blocks - max(0, held - (8 - first_blocks))
        assert cached.block_ids == tuple(range(survivors))
        fits = -(-len(follow_up) // BLOCK_SIZE) <= 8 - held
        assert mgr.can_allocate("next", len(follow_up), cached) == fits
        if fits:
            assert mgr.allocate("next", len(follow_up), cached)[:survivors] == cached.block_ids
        else:
            with pytest.raises(NoFreeBlocksError):
                mgr.allocate("next", len(follow_up), cached)
        mgr.check_integrity()


def test_hits_on_blocks_in_use_consume_no_free_capacity():
    mgr, _ = make(num_blocks=3)
    run_prompt(mgr, "a", list(range(8)))
    prompt = list(range(8)) + [9]
    cached = mgr.find_cached_prefix(prompt, hash_blocks(NS, prompt))
    assert cached == CachedPrefix((0, 1), 8)
    assert mgr.can_allocate("b", 9, cached)
    assert not mgr.can_allocate("b", 9)
    assert mgr.allocate("b", 9, cached) == (0, 1, 2)
    mgr.check_integrity()


def test_events_in_order_through_the_manager():
    mgr, events = make(num_blocks=3)
    tokens = list(range(10))
    hashes = hash_blocks(NS, tokens)
    mgr.allocate("a", 10)
    mgr.cache_blocks("a", tokens, hashes, 5)  # only block 0 is full and computed
    mgr.cache_blocks("a", tokens, hashes, 5)  # nothing new: no event
    mgr.cache_blocks("a", tokens, hashes, 10)
    mgr.free("a")
    assert mgr.allocate("b", 8) == (2, 1)  # the uncached partial block goes first, evicting nothing
    assert events == [
        BlockStored((hashes[0],), None, (0, 1, 2, 3)),
        BlockStored((hashes[1],), hashes[0], (4, 5, 6, 7)),
        BlockRemoved((hashes[1],)),
    ]


def test_decode_growth_registers_new_blocks_incrementally():
    mgr, events = make()
    marked = []
    mark_cached = mgr._pool.mark_cached
    mgr._pool.mark_cached = lambda block_id, *args, **kwargs: (marked.append(block_id),
                                                               mark_cached(block_id, *args, **kwargs))
    tokens = list(range(6))
    hashes = hash_blocks(NS, tokens)
    mgr.allocate("a", 6)
    mgr.cache_blocks("a", tokens, hashes, 6)
    for token in range(6, 13):  # one token per decode step
        tokens.append(token)
        hashes = extend_block_hashes(NS, tokens, hashes)
        mgr.allocate("a", len(tokens))
        mgr.cache_blocks("a", tokens, hashes, len(tokens) - 1)  # the newest token is not computed yet
    assert mgr.block_table("a") == (0, 1, 2, 3)
    assert [e.block_hashes[0] for e in events] == hash_blocks(NS, tokens)[:3]
    assert marked == [0, 1, 2]  # each block visited once: cache_blocks costs O(new blocks) per step
    mgr.check_integrity()


def test_prefix_caching_disabled():
    mgr, events = make(enable_prefix_caching=False)
    tokens = list(range(10))
    run_prompt(mgr, "a", tokens)
    assert events == []
    assert mgr.find_cached_prefix(tokens, hash_blocks(NS, tokens)) == EMPTY_PREFIX
    mgr.check_integrity()


def test_stale_prefix_is_rejected():
    mgr, _ = make(num_blocks=3)
    run_prompt(mgr, "a", list(range(8)))
    mgr.free("a")
    prompt = list(range(8)) + [9]
    cached = mgr.find_cached_prefix(prompt, hash_blocks(NS, prompt))
    mgr.allocate("other", 12)  # evicts blocks 0 and 1 behind the first caller's back
    mgr.free("other")
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate("b", 9, cached)
    assert not mgr.has("b")
    mgr.check_integrity()


def test_free_releases_tail_first_and_ignores_unknown_ids():
    mgr, _ = make(num_blocks=4)
    mgr.allocate("a", 12)
    mgr.free("a")
    mgr.free("a")
    mgr.free("never-seen")
    assert not mgr.has("a")
    assert mgr.allocate("b", 16) == (3, 2, 1, 0)
    mgr.check_integrity()


def test_argument_validation():
    mgr, _ = make()
    run_prompt(mgr, "a", list(range(10)))
    with pytest.raises(ValueError, match="already has blocks"):
        mgr.allocate("a", 12, CachedPrefix((0,), 4))
    with pytest.raises(ValueError, match="does not fit"):
        mgr.allocate("b", 3, CachedPrefix((0,), 4))
    with pytest.raises(ValueError, match="does not fit"):
        mgr.allocate("b", 8, CachedPrefix((0, 0), 8))
    with pytest.raises(ValueError, match="num_tokens"):
        mgr.can_allocate("b", -1)
    with pytest.raises(ValueError, match="computed full blocks"):
        mgr.cache_blocks("a", list(range(10)), [], 8)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    mgr.check_integrity()


def _corrupt_table_holds_unreferenced_block(mgr):
    mgr._tables["a"].append(5)


def _corrupt_extra_reference(mgr):
    mgr._pool.acquire([0])


def _corrupt_block_held_twice(mgr):
    mgr._pool.acquire([1])
    mgr._tables["a"].append(1)


def _corrupt_registered_count(mgr):
    mgr._num_registered["a"] = 7


def _corrupt_pool(mgr):
    mgr._pool._ref_counts[9] = 1


@pytest.mark.parametrize("corrupt, message", [
    (_corrupt_table_holds_unreferenced_block, "block 5 has ref count 0 but 1 tables hold it"),
    (_corrupt_extra_reference, "block 0 has ref count 2 but 1 tables hold it"),
    (_corrupt_block_held_twice, "holds a block twice"),
    (_corrupt_registered_count, "impossible registered-block count"),
    (_corrupt_pool, "block 9 .* free queue iff"),
])
def test_check_integrity_catches_corruption(corrupt, message):
    mgr, _ = make()
    run_prompt(mgr, "a", list(range(10)))
    mgr.check_integrity()
    corrupt(mgr)
    with pytest.raises(IntegrityError, match=message):
        mgr.check_integrity()


# Three prompt families; 0 and 1 share their first two blocks so prefix hits and sharing happen often.
BASES = [list(range(40)), list(range(8)) + list(range(500, 532)), list(range(1000, 1040))]
OPS = st.lists(st.tuples(st.sampled_from(["new", "followup", "grow", "compute", "free"]),
                         st.integers(0, 5), st.integers(1, 14)), max_size=40)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, prefix_caching=st.booleans())
def test_random_operations_keep_integrity(ops, prefix_caching):
    mgr = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    live: dict[str, list] = {}  # seq_id -> [tokens, hashes, num_computed]
    history: list[list[int]] = []  # every prompt offered so far, for follow-up turns
    for step, (kind, pick, amount) in enumerate(ops):
        seq_id = sorted(live)[pick % len(live)] if live else None
        if kind == "new":
            history.append(BASES[pick % 3][:amount + 4])
            _admit(mgr, live, f"s{step}", history[-1])
        elif kind == "followup" and history:  # a later turn of a conversation: an old prompt, extended
            history.append(history[pick % len(history)] + [3000 + step] * (amount % 5 + 1))
            _admit(mgr, live, f"s{step}", history[-1])
        elif kind == "grow" and seq_id is not None:
            _grow(mgr, live[seq_id], seq_id, amount)
        elif kind == "compute" and seq_id is not None:
            state = live[seq_id]
            state[2] = min(len(state[0]), state[2] + amount)
            mgr.cache_blocks(seq_id, state[0], state[1], state[2])
        elif kind == "free" and seq_id is not None:
            if amount % 2:  # a finished sequence computed everything; otherwise it was aborted mid-way
                mgr.cache_blocks(seq_id, live[seq_id][0], live[seq_id][1], len(live[seq_id][0]))
            mgr.free(seq_id)
            del live[seq_id]
        mgr.check_integrity()
    for seq_id in list(live):
        mgr.free(seq_id)
    mgr.check_integrity()
    assert mgr.num_free_blocks == 8 and mgr.usage == 0.0


def _admit(mgr, live, seq_id, tokens):
    hashes = hash_blocks(NS, tokens)
    cached = mgr.find_cached_prefix(tokens, hashes)
    assert cached.num_tokens < len(tokens)
    for i, block_id in enumerate(cached.block_ids):
        assert mgr._pool.cached_tokens(block_id) == tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
    if not mgr.can_allocate(seq_id, len(tokens), cached):
        with pytest.raises(NoFreeBlocksError):
            mgr.allocate(seq_id, len(tokens), cached)
        return
    table = mgr.allocate(seq_id, len(tokens), cached)
    assert table[:len(cached.block_ids)] == cached.block_ids
    assert len(table) == -(-len(tokens) // BLOCK_SIZE)
    live[seq_id] = [list(tokens), hashes, cached.num_tokens]


def _grow(mgr, state, seq_id, amount):
    tokens = state[0] + [2000 + len(state[0]) + i for i in range(amount)]
    if mgr.can_allocate(seq_id, len(tokens)):
        mgr.allocate(seq_id, len(tokens))
        state[0], state[1] = tokens, extend_block_hashes(NS, tokens, state[1])
