"""What the simulator moves around: the requests it is given and the sequences it runs.

`SimRequest` is plain data (any workload can produce it: `splitserve bench`'s generators through
`loadtest.sim_workload`, the online planner from what routers observed). `SimSeq` is one request's
mutable state inside a run, counters as in the engine (engine/sequence.py): `computed` catches up to
`prompt`, then each step yields one token until `emitted == output`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from common.messages import PrefixPull
from engine.block_hash import BLOCK_HASH_BYTES, BlockHash
from sim.result import SimRecord


class SimRequest(NamedTuple):
    arrival_s: float  # when the client sends it (before any client-side concurrency cap)
    prompt_tokens: int
    output_tokens: int  # tokens it generates (as the bench forces them: min = max, EOS ignored)
    # Identities of its prompt's full cache blocks, in order (see sim/kv.py): equal leading
    # keys mean an equal prefix. Chained block hashes, or any hashable standing for one (the
    # simulator digests it: `block_hashes`). Empty: nothing to share.
    block_keys: tuple[Hashable, ...] = ()


@dataclass(eq=False, slots=True)
class SimSeq:
    index: int  # position in the request list
    arrival_s: float
    prompt: int  # tokens to prefill in this attempt: the prompt, plus what was streamed before a migration
    output: int  # total output tokens
    keys: tuple = ()  # block hashes of the prompt's full cache blocks (`block_hashes` of its keys)
    prompt_tokens: int = 0  # the request's own prompt (`prompt` grows by what a migration carries over)
    stage: str = "new"  # new, routing, prefill, pinned (first token out, KV not moved yet), adopting, decode, done
    send_s: float = 0.0
    emitted: int = 0  # output tokens produced so far (all attempts)
    computed: int = 0  # prefill progress of this attempt
    cached: int = 0  # prompt tokens found in the prefix cache (first attempt), pulled ones included
    pulled: int = 0  # of those, prompt tokens a prefix pull brought (first attempt)
    pull: PrefixPull | None = None  # the pull the router asked of this attempt's prefill worker
    pull_table: list[int] = field(default_factory=list)  # the pulled prefix's blocks, pinned until admitted
    pull_ready_s: float = 0.0  # when the pulled KV has arrived: the engine cannot admit it before
    table: list[int] = field(default_factory=list)  # prefill / colocated worker's blocks
    registered: int = 0  # leading blocks of `table` already marked cached
    decode_blocks: int = 0
    join_step: int = 0  # decode: the worker's step count when it joined the batch
    join_tokens: int = 0  # decode: its length then
    finish_step: int = 0
    first_token_s: float | None = None  # as the client sees them
    last_token_s: float | None = None
    prefill_worker: int = -1
    decode_worker: int = -1
    estimate_tokens: int = 0  # what the router booked on the prefill worker's queue
    booked: bool = False  # the router's ledger counts it on `prefill_worker` (from routing to its end)
    migrations: int = 0
    status: str = "pending"  # pending, ok, rejected, failed
    refusal: str = ""  # rejected: why (the router's concurrency limit, or the admission policy's cause)
    tokens_through: int = 0  # admitted: uncached tokens queued on its prefill worker then, its own included
    wake_s: float = 0.0  # sent to an idle cluster: the wake-up its first routing waits (Overheads.wake_s)

    @property
    def decode_left(self) -> int:
        return self.output - self.emitted

    def record(self) -> SimRecord:
        """What the run's result keeps of it (a request still pending at the end failed)."""
        status = "failed" if self.status == "pending" else self.status
        return SimRecord(
            self.index,
            self.arrival_s,
            self.send_s,
            self.prompt_tokens,
            self.output,
            self.cached,
            self.first_token_s,
            self.last_token_s,
            status,
            self.migrations,
            self.pulled,
            self.refusal,
        )


def shared_keys(requests: Sequence[SimRequest]) -> set:
    """Block keys that occur in more than one request: the only ones a prefix hit can ever find."""
    seen, shared = set(), set()
    for r in requests:
        for key in r.block_keys:
            if key in seen:
                shared.add(key)
            else:
                seen.add(key)
    return shared


def useful_keys(keys: tuple, shared: set | None, keep: int = 0) -> tuple:
    """The keys up to the last one another request shares, and at least the first `keep` (the
    `prefix_hash` ring is keyed on the prompt's leading blocks, shared or not). Registering the rest in
    the cache would change no hit and no eviction (cached or not, a free block sits in the same LRU
    queue): dropping them only saves work. Kept whole when faults run (a migrated request hits its own
    blocks)."""
    if shared is None:
        return tuple(keys)
    end = len(keys)
    while end > keep and keys[end - 1] not in shared:
        end -= 1
    return tuple(keys[:end])


def block_hashes(keys: Sequence[Hashable]) -> tuple[BlockHash, ...]:
    """The block hashes the keys stand for, as the prefix index takes them (16 bytes each): a key that is
    one already is kept (`loadtest.sim_workload` keys prompts by their real chained hashes), any other
    is digested from its repr (equal keys, equal hashes; a trace's (hash id, block) pairs)."""
    return tuple(
        BlockHash(key)
        if type(key) is bytes and len(key) == BLOCK_HASH_BYTES
        else BlockHash(hashlib.blake2b(repr(key).encode(), digest_size=BLOCK_HASH_BYTES).digest())
        for key in keys
    )
