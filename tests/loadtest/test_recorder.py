"""The recorder turns a backend's stream events and errors into exact records."""
from __future__ import annotations

from loadtest.backends import StreamEvent
from loadtest.plan import PlannedRequest, Slo
from loadtest.recorder import RequestRecorder

PLANNED = PlannedRequest(3, 1.0, (5, 6, 7, 8), 3, Slo(100.0, None), priority=2, tenant="a")


def chunk(tokens, cached=None, reported=None, finish=None, exact=True, migrations=0) -> StreamEvent:
    return StreamEvent(len(tokens), cached, reported, finish, tuple(tokens) if exact else (), migrations, exact)


def test_a_completed_stream():
    r = RequestRecorder(PLANNED, "run-000003", send_s=1.25)
    r.on_event(chunk([11], cached=2), 1.30)
    r.on_event(chunk([12, 13]), 1.40)
    r.on_event(chunk([], cached=4, reported=3, finish="length", migrations=1), 1.45)
    r.on_stream_end(1.46)
    record = r.record(9.0)
    assert (record.request_id, record.index, record.arrival_s, record.send_s) == ("run-000003", 3, 1.0, 1.25)
    assert record.token_times_s == (1.30 - 1.25, 1.40 - 1.25, 1.40 - 1.25)  # a message's tokens share its time
    assert record.e2e_s == 1.45 - 1.25
    assert (record.cached_prompt_tokens, record.finish_reason, record.error_code) == (4, "length", None)
    assert (record.prompt_tokens, record.max_tokens, record.ttft_slo_ms, record.tpot_slo_ms) == (4, 3, 100.0, None)
    assert (record.priority, record.tenant, record.ok) == (2, "a", True)
    assert (record.token_ids, record.migrations) == ((11, 12, 13), 1)


def test_an_error_after_the_first_token_keeps_what_came():
    r = RequestRecorder(PLANNED, "x", send_s=0.0)
    r.on_event(chunk([11], cached=0), 0.2)
    r.on_error("UNAVAILABLE", "worker lost", 0.5)
    r.on_error("CANCELLED", "later", 0.9)  # the first error sticks
    record = r.record(1.0)
    assert (record.token_times_s, record.e2e_s, record.error_code, record.error_reason) == \
        ((0.2,), 0.5, "UNAVAILABLE", "worker lost")
    assert record.finish_reason is None and not record.ok and not record.met_slo


def test_still_running_is_cancelled_and_a_stream_without_finish_is_an_error():
    running = RequestRecorder(PLANNED, "x", send_s=0.0)
    running.on_event(chunk([11]), 0.2)
    assert not running.done
    record = running.record(3.0)
    assert (record.error_code, record.e2e_s, record.output_tokens) == ("CANCELLED", 3.0, 1)
    cut = RequestRecorder(PLANNED, "y", send_s=0.0)
    cut.on_event(chunk([11]), 0.2)
    cut.on_stream_end(0.3)
    assert (cut.record(5.0).error_code, cut.record(5.0).e2e_s) == ("CLIENT_ERROR", 0.3)


def test_guessed_token_counts_yield_to_the_servers_count():
    r = RequestRecorder(PLANNED, "z", send_s=0.0)
    for t in (0.1, 0.2, 0.3):  # three chunks of text, tokens unknown
        r.on_event(chunk([0], exact=False), t)
    r.on_event(chunk([], finish="length", exact=False), 0.35)
    r.on_event(chunk([], cached=0, reported=6), 0.36)  # usage: 6 tokens, not 3
    r.on_stream_end(0.37)
    record = r.record(1.0)
    assert record.token_times_s == (0.1, 0.2, 0.2, 0.2, 0.3, 0.3)  # first keeps 1; 5 spread, earlier first
    assert record.ttft_s == 0.1 and record.e2e_s == 0.35 and record.output_tokens == 6
    exact = RequestRecorder(PLANNED, "e", send_s=0.0)
    exact.on_event(chunk([1, 2]), 0.1)
    exact.on_event(chunk([], reported=5, finish="length"), 0.2)  # exact counts are never rewritten
    assert exact.record(1.0).token_times_s == (0.1, 0.1)
