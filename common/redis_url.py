"""Redis URLs: one standalone server (`redis://`, `rediss://`, `unix://`) or a Redis Cluster by its seeds.

    redis://HOST:PORT[/DB]                       one server (redis-py's own URL forms, passed through)
    redis+cluster://HOST:PORT[,HOST:PORT...]     a Redis Cluster: any reachable seed tells the client
                                                 the others and which shard serves which slot
    rediss+cluster://...                         the same over TLS

Parsed once at the edge (config validation) and again by whatever connects (the prefix index; a KV
store later), so every user agrees on the forms. A bad URL raises ValueError in one line naming the
field and what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

STANDALONE_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True)
class RedisTarget:
    url: str  # as given
    cluster: bool
    seeds: tuple[tuple[str, int], ...] = ()  # (host, port) of each cluster seed; empty for a standalone URL
    tls: bool = False


def parse_redis_url(url: str, field: str = "redis_url") -> RedisTarget:
    """The target `url` names; ValueError naming `field` when it is malformed."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{field}: must be a non-empty string, got {url!r}")
    if url.startswith(STANDALONE_SCHEMES):
        return RedisTarget(url, cluster=False, tls=url.startswith("rediss://"))
    scheme = next((s for s in CLUSTER_SCHEMES if url.startswith(s)), None)
    if scheme is None:
        known = ", ".join(STANDALONE_SCHEMES + CLUSTER_SCHEMES)
        raise ValueError(f"{field}: must start with one of {known}, got {url!r}")
    rest = url[len(scheme) :].rstrip("/")
    if rest.endswith("/0"):  # a cluster has only database 0; saying so is allowed
        rest = rest[:-2]
    if not rest or "/" in rest or "@" in rest or "?" in rest:
        raise ValueError(f"{field}: a cluster URL is {scheme}HOST:PORT[,HOST:PORT...], got {url!r}")
    seeds = tuple(_seed(part, url, field) for part in rest.split(","))
    return RedisTarget(url, cluster=True, seeds=seeds, tls=scheme.startswith("rediss"))


def _seed(part: str, url: str, field: str) -> tuple[str, int]:
    host, sep, port = part.strip().rpartition(":")
    host = host.strip("[]")  # [::1]:7000
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: seed {part!r} of {url!r} is not HOST:PORT with a port in 1-65535")
    return host, int(port)
