"""The messages that cross process boundaries between the client side and the workers: ids and
numbers only (token ids, block ids, params), never model objects."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.speculative.counters import SpecCounters
from engine.step_log import StepRecord


@dataclass(frozen=True)
class PrefixPull:
    """Before computing, fetch the prompt's first `num_blocks` KV blocks from the prefill worker
    `holder_id` (which the prefix index says holds them) instead of recomputing them."""

    holder_id: str
    num_blocks: int


@dataclass(frozen=True)
class PullOutcome:
    """What a prefix pull did: blocks received from the holder (0: it fell back to recomputing)."""

    num_blocks: int
    num_bytes: int
    duration_s: float
    error: str | None = None


@dataclass(frozen=True)
class TraceContext:
    """Where a request's trace continues in another process (common/tracing.py): the W3C trace context of
    the span that sent it, and the client's request id (a worker sees only the attempt's id)."""

    traceparent: str
    request_id: str
    tracestate: str = ""


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    tenant: str = ""  # salts block hashes: tenants never share prefix-cache entries
    prefix_pull: PrefixPull | None = None
    deadline_s: float | None = None  # time.time() by which the request must be done; None: no bound
    # Tokens the request already streamed (a migrated request resumes after them; they count as output).
    output_token_ids: tuple[int, ...] = ()
    trace_context: TraceContext | None = None  # set only while tracing is on

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token whose KV the prefill computes: the prompt, then what was already streamed."""
        return tuple(self.prompt_token_ids) + tuple(self.output_token_ids)


@dataclass(frozen=True)
class PrefillResult:
    """The first token, from the prefill worker. `handoff` says the sequence continues on decode."""

    request_id: str
    token_id: int
    logprobs: object | None  # engine.sampler.TokenLogprobs
    finish_reason: str | None
    handoff: bool
    num_cached_tokens: int  # context tokens served from cache, pulled ones included (a migrated request's
    # context is its prompt and the tokens it already streamed)
    prefill_time_s: float
    pull: PullOutcome | None = None  # set when the request asked for a prefix pull
    # params.prompt_logprobs: TokenLogprobs of prompt tokens 1.. (a resumed request computes none: None)
    prompt_logprobs: tuple | None = None
    text_end_chars: int | None = None  # a stop string ended it: the output text ends after this many characters


@dataclass(frozen=True)
class PrefillQueue:
    """Before its first token: the request waits in the prefill worker's queue or for its prefix pull
    (`waiting`; sent after a step that did not schedule it, and before a pull starts), or it left the
    queue and is being computed (not `waiting`; sent before that step runs). A request without a pull
    that the first step after its arrival scheduled gets neither. The router counts the worker's death
    toward `migration_limit` unless the request was waiting: a queued request cannot have caused it."""

    request_id: str
    waiting: bool


@dataclass(frozen=True)
class FilledBlocks:
    """Rank 0 of a tensor-parallel decode instance to its other ranks: blocks its pool registered right
    after the step that filled them; each rank stores its KV heads of them (decode_worker/shard_store.py).
    Parallel tuples: the step's sequence number in the TP group, the block id, the block hash."""

    step_sequences: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class TokenUpdate:
    """Tokens a decode instance produced for one request since the last poll; `error` set on failure."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple
    finish_reason: str | None = None
    error: str | None = None
    text_end_chars: int | None = None  # a stop string ended it: the output text ends after this many characters


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    peer_ids: tuple[str, ...]  # transport ids (decode: one per rank)
    num_blocks: int
    block_size: int
    num_kv_heads: int
    hash_spec: str
    model_identity: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_bytes_per_token: int = 0  # KV cache bytes one token occupies (all layers, K and V)
    epoch: int = 0  # which start of the worker this is (the controller counts them)


@dataclass(frozen=True)
class WorkerStats:
    """A worker's load and recent engine steps: what routers read for load and cost models. Answered
    from the engine loop's last snapshot, so a busy engine never delays it."""

    waiting: int
    running: int
    num_free_blocks: int
    num_blocks: int
    steps: tuple[StepRecord, ...]  # the newest engine steps, oldest first
    in_flight: int = 0  # prefill: hand-offs in progress; decode: reservations whose KV has not arrived
    metrics_port: int | None = None  # the worker's Prometheus endpoint, when it has one
    spec: SpecCounters | None = None  # decode with speculative decoding: its cumulative counters
    kv_tiers: tuple[KVTierStatus, ...] = ()  # its KV tiers beyond the pool (kv_store/), upper first
    store_reads: StoreReads | None = None  # a prefill worker with KV tiers: what its fetches took

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class KVTierStatus:
    """One KV tier of a worker (kv_store/), counted since the worker started."""

    tier: str  # "host", "disk" or "redis"
    used_bytes: int
    capacity_bytes: int  # 0: bounded by the store itself
    hits: int
    misses: int


@dataclass(frozen=True)
class StoreReads:
    """A prefill worker's fetches from its KV tiers since it started, for the router's fetch price."""

    layout: str  # hex digest of its KV layout (the store's keys carry it: kv_store/block_record.py)
    fetched_bytes: int  # KV payload bytes loaded into its pool from the tiers
    fetch_s: float  # time those fetches took, reading through loading into the pool
    # Of those, the fetches whose every block came from the worker's own host tier (the router prices a
    # host-tier fetch by these, per worker).
    host_fetched_bytes: int = 0
    host_fetch_s: float = 0.0
    # Hex digests of the layouts of the head shards a TP decode instance stores (one per head range, in
    # head order: kv_store/block_shards.py), which it assembles blocks from; empty when decode instances
    # write whole records. The router counts a block held as a complete set of these as held.
    shard_layouts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Liveness:
    """A worker's answer to the controller's health check (from its event loop, never its engine)."""

    worker_id: str
    epoch: int
    engine_ok: bool  # False: the engine loop died (the worker must be replaced)
    error: str | None = None
