"""Which failures of a Redis call mean "the index cannot answer now" (`PrefixIndexUnavailable`).

Both Redis indexes (standalone and cluster) decide it here, in one place:
- the client's own errors (`RedisError`, `RedisClusterException`, which does not derive from it),
  socket errors and timeouts;
- any other exception raised inside redis-py itself. Its asyncio cluster client closes every
  connection of its nodes after a connection error or a topology change, including connections other
  coroutines are sending on at that moment: those commands fail on the half-closed connection with an
  `AttributeError` (its writer is gone) rather than a `ConnectionError`. To a caller that is the same
  "no answer now": routing falls back to `prefix_hash`, the publisher resends.
An exception raised in splitserve's own code (no redis-py frame where it was raised) is a bug and
propagates as itself.
"""

from __future__ import annotations

import asyncio

from redis import exceptions as redis_errors

UNAVAILABLE = (redis_errors.RedisError, redis_errors.RedisClusterException, OSError, asyncio.TimeoutError)
_CLIENT_PACKAGE = "redis"


def is_unavailable(err: BaseException) -> bool:
    """Whether `err`, raised by a call to the Redis client, means the index cannot answer now."""
    if isinstance(err, UNAVAILABLE):
        return True
    return isinstance(err, Exception) and _raised_in_client(err)


def _raised_in_client(err: Exception) -> bool:
    """Whether a frame of redis-py is on the traceback (the error came from within the client)."""
    tb = err.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == _CLIENT_PACKAGE or module.startswith(_CLIENT_PACKAGE + "."):
            return True
        tb = tb.tb_next
    return False
