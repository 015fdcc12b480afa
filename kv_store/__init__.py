"""KV block tiers beyond a worker's pool: a bounded host tier (memory, or a memory-mapped local file on a
CPU worker) and a shared store (Redis or Redis Cluster), all keyed by the block hash.

A block record is the bit copy of one block's KV on every layer, exactly as the pool stores it
(`block_record`), under a key that names the KV layout and the block hash (`keys`). Every tier is a
`BlockStore` (`base`): bytes in, bytes out, and a store in trouble answers misses and drops writes, it
never raises into a request. `TieredStore` reads the tiers in order and fills the upper ones on a
lower hit; `StoreWriter` writes off the engine's thread. How a worker uses them (write full blocks as
they are cached, fetch a prompt's missing blocks before computing them) is in `block_io`.
"""
