"""Synthetic tokens, length distributions and Poisson arrivals: deterministic, in range, exact."""
from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest import tokens
from loadtest.arrivals import poisson_arrivals_s
from loadtest.lengths import LengthDist, fit_lengths
from loadtest.plan import ModelLimits
from tests.loadtest.helpers import LIMITS


def test_token_blocks_are_a_pure_function_of_seed_salt_stream_key():
    a = tokens.TokenSource(LIMITS, seed=3)
    b = tokens.TokenSource(LIMITS, seed=3)
    block = a.block(tokens.TRACE_BLOCK, 42, 64)
    assert block == b.block(tokens.TRACE_BLOCK, 42, 64)
    assert len(block) == 64 and all(type(t) is int for t in block)
    assert a.block(tokens.TRACE_BLOCK, 42, 10) == block[:10]  # a block's prefix does not depend on its length
    assert a.blocks(tokens.TRACE_BLOCK, [7, 42, 7], 64).tolist() == [list(a.block(tokens.TRACE_BLOCK, 7, 64)),
                                                                       list(block), list(a.block(tokens.TRACE_BLOCK, 7, 64))]
    others = [tokens.TokenSource(LIMITS, seed=4).block(tokens.TRACE_BLOCK, 42, 64),
              tokens.TokenSource(LIMITS, seed=3, salt=1).block(tokens.TRACE_BLOCK, 42, 64),
              a.block(tokens.TRACE_PROMPT, 42, 64), a.block(tokens.TRACE_BLOCK, 43, 64)]
    assert all(other != block for other in others)


def test_token_ids_cover_the_vocabulary_but_never_eos():
    limits = ModelLimits(max_model_len=64, vocab_size=10, block_size=4, eos_token_ids=(0, 9))
    ids = tokens.TokenSource(limits, seed=0).blocks(tokens.POISSON_PROMPT, range(50), 40).ravel()
    assert set(ids.tolist()) == {1, 2, 3, 4, 5, 6, 7, 8}
    assert ids.dtype == np.int64


def test_model_limits_reject_what_no_workload_can_use():
    with pytest.raises(ValueError, match="max_model_len"):
        ModelLimits(max_model_len=1, vocab_size=10, block_size=4)
    with pytest.raises(ValueError, match="no token id"):
        ModelLimits(max_model_len=8, vocab_size=1, block_size=4, eos_token_ids=(0,))


def test_length_distributions_parse_and_sample_exactly():
    assert LengthDist.parse("fixed:7").sample(np.random.default_rng(0), 3).tolist() == [7, 7, 7]
    uniform = LengthDist.parse("uniform:5,6").sample(np.random.default_rng(0), 200)
    assert set(uniform.tolist()) == {5, 6}
    expected = np.maximum(np.rint(np.random.default_rng(1).lognormal(math.log(100) - 0.5 ** 2 / 2, 0.5, 1000)), 1)
    lognormal = LengthDist.parse("lognormal:100,0.5").sample(np.random.default_rng(1), 1000)
    assert lognormal.tolist() == expected.astype(int).tolist()
    assert 90 < lognormal.mean() < 110  # parameterised by its mean, not the log-space mean
    assert LengthDist.parse(" uniform:1,3 ").spelling == "uniform:1,3"


@pytest.mark.parametrize("text, message", [
    ("7", "must be one of"), ("gauss:1,2", "unknown length distribution"), ("fixed:1,2", "takes 1 value"),
    ("fixed:0", "integers >= 1"), ("fixed:1.5", "integers >= 1"), ("uniform:9,3", "LO <= HI"),
    ("lognormal:0.5,1", "MEAN >= 1"), ("lognormal:10,x", "must be numbers"), ("fixed:inf", "finite"),
])
def test_bad_length_distributions_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        LengthDist.parse(text)


def test_fit_lengths_leaves_room_for_one_output_token():
    prompts, outputs = fit_lengths(np.array([10, 600, 511, 100]), np.array([5, 5, 9, 412]), 512)
    assert prompts.tolist() == [10, 511, 511, 100]
    assert outputs.tolist() == [5, 1, 1, 412]


def test_poisson_arrivals_scale_with_the_rate_and_start_at_zero():
    at_1 = poisson_arrivals_s(np.random.default_rng(5), 1000, 1.0)
    at_4 = poisson_arrivals_s(np.random.default_rng(5), 1000, 4.0)
    assert at_1[0] == 0.0 and np.all(np.diff(at_1) >= 0)
    assert np.allclose(at_4, at_1 / 4.0, rtol=0, atol=1e-12)
    assert 0.9 < 999 / at_1[-1] < 1.1  # mean rate over the run
    assert poisson_arrivals_s(np.random.default_rng(5), 3, math.inf).tolist() == [0.0, 0.0, 0.0]
    assert poisson_arrivals_s(np.random.default_rng(5), 1, 2.0).tolist() == [0.0]
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals_s(np.random.default_rng(5), 3, 0.0)
