"""One cluster for the observability tests: 1 prefill worker and 2 decode instances (a migration needs
somewhere to go) with every exporter on (router and workers, on free ports) and tracing to a real OTLP
receiver. The tracing module's migration test kills a decode instance: it runs last."""
from __future__ import annotations

from dataclasses import replace

import pytest

from common import tracing
from tests.factories import TinySpec
from tests.observability.otlp_receiver import OtlpReceiver
from tests.router.conftest import SMALL_POOL, router_config, start_router


@pytest.fixture(scope="package")
def otlp_receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def stack(ray_session, checkpoint, otlp_receiver):
    pool = replace(SMALL_POOL, metrics_port=0)  # each worker serves its own exporter on a free port
    config = replace(router_config(metrics_port=0), prefill=pool, decode=replace(pool, replicas=2),
                     otlp_traces_endpoint=otlp_receiver.endpoint)
    stack = start_router(checkpoint(TinySpec()), config)
    yield stack
    try:
        stack.stop()
    finally:
        tracing.shutdown()  # the router's spans were this process's: later tests run with tracing off
