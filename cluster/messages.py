"""The messages that cross process boundaries between the client side and the workers: ids and
numbers only (token ids, block ids, params), never model objects."""
from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    tenant: str = ""  # salts block hashes: tenants never share prefix-cache entries


@dataclass(frozen=True)
class PrefillResult:
    """The first token, from the prefill worker. `handoff` says the sequence continues on decode."""

    request_id: str
    token_id: int
    logprobs: object | None  # engine.sampler.TokenLogprobs
    finish_reason: str | None
    handoff: bool
    num_cached_tokens: int
    prefill_time_s: float


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
