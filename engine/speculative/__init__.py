"""Speculative decoding: propose k tokens cheaply, verify them all in one target forward, keep the
accepted prefix plus one target token. Output is exactly the target's: greedy equals plain greedy
decoding token for token; sampled tokens follow the target's distribution (rejection sampling).

- config.py: `speculative_config` (vLLM's keys), validated once.
- ngram.py / draft_model.py: the proposers (prompt lookup; a draft checkpoint with its own paged KV).
- rejection.py: verification (greedy prefix match; the standard rejection-sampling rule).
- adaptive.py: the per-step off-switch from measured costs.
- decoder.py: the engine's hooks, in step order; `build_speculative_decoder` picks the proposer.

Seeded sampled requests: every draw is keyed by (seed, stream, position), so a seeded request replays
identically on every path (colocated, disaggregated, tensor-parallel) for the same speculation
decisions. Rejection sampling draws differ from plain sampling's, so with `adaptive` on, whose
decisions follow measured timings, a seeded *sampled* request may differ between runs (its
distribution never does); greedy requests are always exact. Set `adaptive: false` for bit-replay.
"""
