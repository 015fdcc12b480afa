"""`splitserve bench` workloads as simulator input: a `WorkloadSpec` -> `SimRequest`s.

The simulator (sim/) sits below loadtest/ and takes plain request lists; this is where the
bench's generators feed it, so a simulated run and a measured one replay the same requests:
- poisson / shared-prefix: the very plan the bench sends (same seed: same arrivals, lengths and
  tokens); each prompt's full blocks are keyed by their real chained block hashes
  (engine/block_hash.py, the spec the router and workers use): equal keys exactly where prompts share
  a prefix;
- trace: the same rows, lengths and times as the bench plans (`TraceSpec.layout`), without building
  token ids (a full Mooncake trace is 145 M prompt tokens). A Mooncake row's hash ids are already
  chained prefix ids, so cache block j of trace block h gets key (h, j); Azure rows share nothing.
`repeat_trace` tiles requests into a longer trace (a day from an hour), each copy with its own
prefixes: a synthetic scale-up, labelled so wherever it is used.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import HashNamespace, hash_blocks
from loadtest.config import WorkloadSpec
from loadtest.plan import ModelLimits, Plan, RequestDefaults
from loadtest.trace import TraceSpec
from loadtest.trace_rows import MOONCAKE_BLOCK_TOKENS
from sim.seq import SimRequest

SIM_MODEL_IDENTITY = "splitserve-sim"  # the hash root of simulated prompts (only equality matters)


def limits_of(profile) -> ModelLimits:
    """The served model's limits as the bench would learn them from the router, from a profile."""
    model = profile.model
    return ModelLimits(model.max_model_len, model.vocab_size, model.block_size, tuple(model.eos_token_ids))


def sim_requests(
    spec: WorkloadSpec, limits: ModelLimits, block_tokens: int, seed: int = 0, salt: int = 0
) -> tuple[list[SimRequest], dict]:
    """(requests, the plan's notes) for `spec`, prefix keys at `block_tokens` per cache block."""
    if isinstance(spec, TraceSpec):
        return _trace_requests(spec, limits, block_tokens, seed)
    plan = spec.build(limits, RequestDefaults(), seed, salt)
    return plan_requests(plan, block_tokens), dict(plan.notes)


def plan_requests(plan: Plan, block_tokens: int) -> list[SimRequest]:
    return [
        SimRequest(r.arrival_s, r.num_prompt_tokens, r.max_tokens, chained_keys(r.prompt_token_ids, block_tokens))
        for r in plan.requests
    ]


def chained_keys(token_ids: Sequence[int], block_tokens: int) -> tuple[bytes, ...]:
    return tuple(hash_blocks(HashNamespace(SIM_MODEL_IDENTITY, block_tokens), token_ids))


def _trace_requests(spec: TraceSpec, limits: ModelLimits, block_tokens: int, seed: int):
    layout = spec.layout(limits, seed)
    trace_block = round(layout.prompt_scale * MOONCAKE_BLOCK_TOKENS)
    if layout.trace.format == "mooncake" and trace_block % block_tokens:
        raise ValueError(
            f"a trace block of {trace_block} tokens is not a whole number of {block_tokens}-token cache blocks"
        )
    per_block = trace_block // block_tokens
    requests = []
    for row_index, (prompt, output), arrival_s in zip(layout.rows, layout.lengths, layout.arrivals_s, strict=True):
        hash_ids = layout.trace.rows[row_index].hash_ids or ()
        full = prompt // block_tokens
        keys = tuple((h, j) for h in hash_ids for j in range(per_block))[:full]
        requests.append(SimRequest(float(arrival_s), prompt, output, keys))
    return requests, dict(layout.notes)


def repeat_trace(requests: Sequence[SimRequest], copies: int, period_s: float | None = None) -> list[SimRequest]:
    """`copies` back-to-back copies of `requests` (copy c shifted by c * period_s, default the span
    plus the mean gap), each with prefix keys of its own (c, key): as many users again, not the same
    users returning."""
    if copies < 1:
        raise ValueError(f"--repeat must be >= 1, got {copies}")
    if not requests:
        return []
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    period_s = period_s if period_s is not None else span_s + span_s / max(len(requests) - 1, 1)
    out = []
    for c in range(copies):
        for r in requests:
            keys = r.block_keys if c == 0 else tuple((c, k) for k in r.block_keys)
            out.append(SimRequest(r.arrival_s + c * period_s, r.prompt_tokens, r.output_tokens, keys))
    return out
