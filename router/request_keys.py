"""Small pure helpers of the router's request path: the route query of a prompt, timing a stream."""

from __future__ import annotations

import array
import sys
import time
from collections.abc import AsyncGenerator, Sequence

from engine.block_hash import HashNamespace, hash_blocks
from policies.routing import RouteQuery


def route_query(token_ids: Sequence[int], tenant: str, model_identity: str, block_size: int) -> RouteQuery:
    """The chained block hashes routing and the prefix index key on (one spec: engine.block_hash)."""
    hashes = tuple(hash_blocks(HashNamespace(model_identity, block_size, tenant), token_ids))
    key = b"" if hashes else _le_uint32(token_ids) + tenant.encode()  # keys only block-less prompts
    return RouteQuery(hashes, len(token_ids), block_size, key)


def _le_uint32(tokens) -> bytes:
    """Token ids as little-endian uint32 bytes, built in C (a Python join costs ~10x more)."""
    packed = array.array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


async def timed(chunks: AsyncGenerator, spent_s: list[float]) -> AsyncGenerator:
    """Passes `chunks` through, adding the time spent waiting on it to spent_s[0]."""
    iterator = chunks  # an async generator is its own iterator, and has the aclose() used below
    try:
        while True:
            started_s = time.perf_counter()
            try:
                chunk = await iterator.__anext__()
            except StopAsyncIteration:
                return
            finally:
                spent_s[0] += time.perf_counter() - started_s
            yield chunk
    finally:
        await iterator.aclose()  # leaving early must still run the cluster client's cleanup


def deadline_from_remaining(time_remaining_s: float | None) -> float | None:
    return None if time_remaining_s is None else time.monotonic() + time_remaining_s
