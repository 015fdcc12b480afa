"""The load-test tool behind `splitserve bench`: drives a running router over gRPC with the client SDK.

1. A workload (`poisson`, `shared_prefix`, `trace`) turns a seeded spec and the served model's limits
   (`ModelInfo`) into a `Plan`: requests with an arrival offset, exact prompt token ids, max_tokens,
   SLO, priority and tenant. The same spec, seed and limits give the same plan, token for token.
2. The driver (`driver`) issues the plan open-loop under a concurrency cap, bounded in count and
   duration, and turns every stream into a `RequestRecord` (`recorder`).
3. `summary` reduces records to latency percentiles, throughput, SLO attainment, goodput, errors by
   reason and prefix hit rate; `plots` draws latency CDFs and rate-sweep curves; `runner` ties it up
   for the CLI (`cli`).
"""
