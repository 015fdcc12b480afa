"""The messages that cross process boundaries between the client side and the workers: ids and
numbers only (token ids, block ids, params), never model objects."""
from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


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
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    tenant: str = ""  # salts block hashes: tenants never share prefix-cache entries
    prefix_pull: PrefixPull | None = None


@dataclass(frozen=True)
class PrefillResult:
    """The first token, from the prefill worker. `handoff` says the sequence continues on decode."""

    request_id: str
    token_id: int
    logprobs: object | None  # engine.sampler.TokenLogprobs
    finish_reason: str | None
    handoff: bool
    num_cached_tokens: int  # prompt tokens served from cache, pulled ones included
    prefill_time_s: float
    pull: PullOutcome | None = None  # set when the request asked for a prefix pull


@dataclass(frozen=True)
class HandoffStats:
    num_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class TokenUpdate:
    """Tokens a decode instance produced for one request since the last poll; `error` set on failure."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple
    finish_reason: str | None = None
    error: str | None = None


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
