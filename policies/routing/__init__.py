"""Routing policies by name (a registry: unknown names fail listing the known ones)."""

from __future__ import annotations

from policies.routing.base import NoWorkersError, RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad
from policies.routing.cache_aware import CacheAwarePolicy
from policies.routing.least_loaded import LeastLoadedPolicy
from policies.routing.load_book import LoadBook
from policies.routing.prefix_hash import PrefixHashPolicy
from policies.routing.round_robin import RoundRobinPolicy

POLICIES = {
    "round_robin": lambda index: RoundRobinPolicy(),
    "least_loaded": lambda index: LeastLoadedPolicy(),
    "prefix_hash": lambda index: PrefixHashPolicy(),
    "cache_aware": lambda index: CacheAwarePolicy(index),
}


def make_policy(name: str, index=None) -> RoutingPolicy:
    """The policy called `name`; `index` (a PrefixIndex) is used by the cache-aware one."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](index)


__all__ = [
    "POLICIES",
    "CacheAwarePolicy",
    "LeastLoadedPolicy",
    "LoadBook",
    "NoWorkersError",
    "PrefixHashPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteQuery",
    "RoutingPolicy",
    "WorkerLoad",
    "make_policy",
]
