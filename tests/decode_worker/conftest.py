"""One pool of rank agents and one rendezvous store for every tensor-parallel test of this package: an
agent is a spawned process that imports torch (seconds on 2 cores), and `Agents.take` replaces the ones a
fault test killed, so the modules share them."""

from __future__ import annotations

import pytest

from tests.decode_worker.test_tp_group import HOST, Agents


@pytest.fixture(scope="package")
def agents():
    pool = Agents(4)
    yield pool
    pool.stop()


@pytest.fixture(scope="package")
def rendezvous():
    from kvtransfer.store import create_rendezvous_store

    return create_rendezvous_store(HOST)
