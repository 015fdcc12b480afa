"""`splitserve chaos`: its report on hand-made records (exact counts), and a short real run in CI —
2 prefill + 2 decode on Ray, a worker SIGKILLed every few seconds under a Poisson workload: nothing
lost, hung, duplicated or diverged; every kill recovered; pools and the prefix index clean after."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import ray

from loadtest.chaos import ChaosConfig, compare, format_report, parse_chaos, run_chaos
from loadtest.records import RequestRecord
from tests.factories import TinySpec
from tests.router.cleanliness import wait_workers_clean
from tests.router.conftest import router_config, start_router


def _record(index: int, tokens=(1, 2, 3), *, max_tokens=3, finish="length", error=None, reason=None,
            migrations=0) -> RequestRecord:
    times = tuple(0.01 * (i + 1) for i in range(len(tokens)))
    return RequestRecord(f"r{index}", index, 0.0, 0.0, 5, max_tokens, times, 0.1, 0, finish, error, reason,
                         token_ids=tuple(tokens), migrations=migrations)


def test_the_report_counts_each_kind_of_harm_exactly():
    reference = [_record(i) for i in range(7)]
    migrated = replace(_record(0, migrations=1), token_times_s=(0.01, 0.02, 0.5), e2e_s=0.55)
    chaos = [migrated, _record(1, (1, 2, 9)),  # diverged
             _record(2, (1, 2, 3, 3), max_tokens=3),  # duplicated (and so diverged)
             _record(3, (1, 2)),  # missing (and diverged)
             _record(4, (1,), finish=None, error="CANCELLED", reason="still running when the bench stopped"),
             _record(5, (), finish=None, error="DEADLINE_EXCEEDED"),
             _record(6, (), finish=None, error="UNAVAILABLE", reason="no healthy decode instance")]
    report = compare(chaos, reference, [{"worker_id": "w", "recovered_s": 2.5}])
    assert (report.requests, report.completed, report.compared) == (7, 4, 4)
    assert (report.lost, report.hung, report.duplicated, report.missing, report.diverged) == (1, 1, 1, 1, 3)
    assert report.failed_by_status == {"UNAVAILABLE": 1}
    assert report.migrations_per_request == {0: 3, 1: 1}
    # its stall: the 0.48 s before its third token, with prompt (5) + 2 streamed tokens to prefill again
    assert report.stalls == [{"index": 0, "migrations": 1, "stall_s": 0.48, "context_tokens": 7,
                              "extra_e2e_s": 0.45}]
    assert report.extra_e2e_unmigrated_s == 0.0
    assert not report.clean and "NOT CLEAN" in format_report(report)
    assert compare(reference, reference, []).clean


def test_a_short_chaos_run_on_2p2d_loses_nothing(ray_session, checkpoint):
    config = router_config()
    stack = start_router(checkpoint(TinySpec()), replace(config, prefill=replace(config.prefill, replicas=2),
                                                         decode=replace(config.decode, replicas=2)))
    try:
        # ~1 s of decoding a request at 4 req/s: both instances hold streams when a kill lands (ties between
        # idle instances go to the first, so shorter streams leave the second idle at times)
        for decode in stack.cluster.decode:
            ray.get(decode.actor.debug_set_step_delay.remote(0.03), timeout=10)
        chaos = parse_chaos(["--target", stack.target, "--workload", "poisson", "--rate", "4",
                             "--num-requests", "400", "--prompt-len", "uniform:16,80", "--output-len", "fixed:32",
                             "--duration-s", "11", "--grace-s", "60", "--kill", "any", "--every-s", "3",
                             "--seed", "3", "--no-progress"])
        started_s = time.monotonic()
        report = asyncio.run(asyncio.wait_for(run_chaos(chaos, stack.cluster.controller, echo=print), 400))
        print(format_report(report), f"({time.monotonic() - started_s:.0f} s)")
        assert report.clean, report.to_dict()
        assert report.requests >= 40 and report.compared == report.requests
        # one kill every 3 s while the workload issues (at 3, 6, 9 s), none while it drains
        assert 3 <= len(report.kills) <= 4 and all(k["at_s"] < 11 for k in report.kills)
        assert all(k["recovered_s"] is not None for k in report.kills)
        assert sum(count for migrations, count in report.migrations_per_request.items() if migrations) >= 1
        stack.cluster.refresh()
        wait_workers_clean(stack.cluster, timeout_s=30)
        stack.loop.call(stack.server.service.index.check_integrity())
    finally:
        stack.stop()


def test_chaos_flags_are_checked():
    import pytest

    with pytest.raises(SystemExit):
        parse_chaos(["--target", "127.0.0.1:1", "--every-s", "0", "--duration-s", "5"])
    with pytest.raises(SystemExit):
        parse_chaos(["--target", "127.0.0.1:1"])  # no --duration-s
    assert isinstance(parse_chaos(["--target", "127.0.0.1:1", "--duration-s", "5"]), ChaosConfig)
