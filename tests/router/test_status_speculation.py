"""GetClusterStatus carries a decode instance's speculative-decoding figures from its WorkerStats."""
from __future__ import annotations

import pytest

from common.messages import WorkerStats
from engine.speculative.counters import SpecCounters
from splitserve_client.protocol import splitserve_v1_pb2 as pb
from router.servicer import _speculation


def test_worker_status_reports_acceptance_and_mean_accepted_length():
    spec = SpecCounters(sequence_steps=10, draft_tokens=40, accepted_tokens=30, steps_on=8, steps_off=2)
    status = pb.WorkerStatus(worker_id="decode-0", **_speculation(WorkerStats(0, 1, 5, 10, (), spec=spec)))
    assert (status.spec_draft_tokens, status.spec_accepted_tokens, status.spec_verify_steps) == (40, 30, 10)
    assert status.spec_acceptance_rate == pytest.approx(0.75)
    assert status.spec_mean_accepted_length == pytest.approx(4.0)
    assert _speculation(WorkerStats(0, 1, 5, 10, ())) == {} and _speculation(None) == {}
