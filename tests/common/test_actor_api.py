"""The typed handles mirror the actors' remote interfaces: every method of a Protocol has a handle method of
the same name and parameters, and every actor class has every method of its Protocol (mypy checks their
types where each class is defined; this holds the handles, which return Ray object refs, to the names)."""
from __future__ import annotations

import inspect

import pytest

from cluster.controller import ClusterController
from common.actor_api import (
    ControllerApi,
    ControllerHandle,
    DecodeRankApi,
    DecodeRankHandle,
    PrefillHandle,
    PrefillWorkerApi,
    WorkerApi,
    WorkerHandle,
)
from decode_worker.worker import DecodeRank
from prefill_worker.worker import PrefillWorker

PAIRS = [(WorkerApi, WorkerHandle, None), (PrefillWorkerApi, PrefillHandle, PrefillWorker),
         (DecodeRankApi, DecodeRankHandle, DecodeRank), (ControllerApi, ControllerHandle, ClusterController)]


def _methods(protocol) -> dict[str, inspect.Signature]:
    names = {name for klass in protocol.__mro__ if klass.__module__ == "common.actor_api"
             for name, value in vars(klass).items() if callable(value) and not name.startswith("_")}
    return {name: inspect.signature(getattr(protocol, name)) for name in names}


def _parameters(signature: inspect.Signature) -> list[tuple[str, object]]:
    # Ray adds a `_ray_trace_ctx` keyword to an actor class's methods once `ray.remote` has wrapped the class
    # in this process (another test may have): it is Ray's, not the interface's.
    return [(p.name, p.default) for p in signature.parameters.values() if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize(("protocol", "handle", "actor"), PAIRS, ids=lambda x: getattr(x, "__name__", "-"))
def test_each_handle_and_actor_has_its_protocols_methods_and_parameters(protocol, handle, actor):
    methods = _methods(protocol)
    assert methods, f"{protocol.__name__} declares no method"
    for name, signature in methods.items():
        assert hasattr(handle, name), f"{handle.__name__} lacks {name}"
        assert _parameters(inspect.signature(getattr(handle, name))) == _parameters(signature), (handle, name)
        if actor is not None:
            assert _parameters(inspect.signature(getattr(actor, name))) == _parameters(signature), (actor, name)


def test_handles_call_only_what_their_actor_defines():
    """A handle method that names no method of its actor would fail only at run time, in a worker."""
    for protocol, handle, actor in PAIRS:
        if actor is None:
            continue
        own = {name for klass in handle.__mro__ if klass.__module__ == "common.actor_api"
               for name, value in vars(klass).items() if callable(value) and not name.startswith("_")}
        extra = own - set(_methods(protocol)) - {"hostname"}  # hostname: Ray's built-in __ray_call__
        assert not extra, f"{handle.__name__} calls {sorted(extra)}, which {protocol.__name__} does not declare"
