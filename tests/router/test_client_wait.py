"""`client_wait_s`: the time since the client sent a request, from the SDK's send-time metadata."""
from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from splitserve_client.sdk_types import SENT_AT_KEY
from router.validation import MAX_CLIENT_WAIT_S, client_wait_s

NOW_US = 1_800_000_000_000_000


def test_the_wait_is_now_minus_the_send_time():
    assert client_wait_s(((SENT_AT_KEY, str(NOW_US - 125_000)),), NOW_US) == 0.125
    assert client_wait_s((("authorization", "Bearer x"), (SENT_AT_KEY, str(NOW_US - 1))), NOW_US) == 1e-6


def test_no_metadata_means_no_wait():
    assert client_wait_s((), NOW_US) == 0.0
    assert client_wait_s(None, NOW_US) == 0.0


def test_a_clock_ahead_or_far_behind_counts_as_no_wait():
    assert client_wait_s(((SENT_AT_KEY, str(NOW_US + 5_000_000)),), NOW_US) == 0.0
    too_old = NOW_US - int((MAX_CLIENT_WAIT_S + 1) * 1e6)
    assert client_wait_s(((SENT_AT_KEY, str(too_old)),), NOW_US) == 0.0


@pytest.mark.parametrize("value", ["", "abc", "-5", "1.5", "１２３", "9" * 21])
def test_a_malformed_send_time_names_the_metadata_key(value):
    with pytest.raises(InvalidRequestError) as err:
        client_wait_s(((SENT_AT_KEY, value),), NOW_US)
    assert SENT_AT_KEY in str(err.value)
