"""The sampler, checked exactly: HF's own processors as the reference, hand-computed numbers, and seeded
draws whose statistics are fixed (every random source here is seeded, so no test can flake)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import engine.sampler as sampler_module
from engine.sampler import Sampler, SamplingRow, processed_logits, row_generator_seed
from engine.sampling_params import SamplingParams

def make_row(prompt=(), output=(), stop_ids=(), **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=list(prompt),
                       output_token_ids=list(output), stop_ids_for_min_tokens=tuple(stop_ids))


def logits_for(probs) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def kept(processed_row: torch.Tensor) -> list[int]:
    return torch.isfinite(processed_row).nonzero().flatten().tolist()


def hf_reference(logits_row: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The same row through HF's processors, in the order engine.logits_processing documents."""
    p = row.params
    input_ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)], dtype=torch.long)
    scores = logits_row.unsqueeze(0).clone()
    if row.stop_ids_for_min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(len(row.prompt_token_ids), p.min_tokens,
                                                   list(row.stop_ids_for_min_tokens))(input_ids, scores)
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[token], bias] for token, bias in p.logit_bias])(input_ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    if p.greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
    if p.top_k is not None:
        scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    return scores[0]


# --- processed_logits against HF -------------------------------------------------------------------

row_strategy = st.builds(
    lambda temperature, top_k, top_p, min_p, rep, min_tokens, prompt, output, stops, bias: make_row(
        prompt=prompt, output=output, stop_ids=stops, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, repetition_penalty=rep, min_tokens=min_tokens, max_tokens=16, logit_bias=bias),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.one_of(st.none(), st.integers(1, 70)),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.1, 1e-6]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    rep=st.sampled_from([1.0, 1.3, 0.7]),
    min_tokens=st.integers(0, 4),
    prompt=st.lists(st.integers(0, 63), max_size=12),
    output=st.lists(st.integers(0, 63), max_size=6),
    stops=st.lists(st.integers(0, 63), max_size=3, unique=True),
    bias=st.dictionaries(st.integers(0, 63), st.sampled_from([-100.0, -2.5, 0.0, 0.3, 4.0, 100.0]), max_size=5),
)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_processed_logits_match_hf_processors_bit_for_bit(rows, seed):
    logits = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(seed)) * 4
    processed = processed_logits(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(processed[i], hf_reference(logits[i], row)), f"row {i}: {row.params}"


def test_repetition_penalty_ignores_ids_outside_the_vocab_like_hf():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = make_row(prompt=[0, 7], output=[1, 99], repetition_penalty=2.0, temperature=0.0)
    assert processed_logits(logits, [row]).tolist() == [[1.0, -4.0, 1.0, 0.5]]
    assert torch.equal(processed_logits(logits, [row])[0], hf_reference(logits[0], row))


def test_logit_bias_hand_computed_before_the_penalty_and_ignoring_ids_outside_the_vocab():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = make_row(prompt=[2], logit_bias={0: -3.0, 2: 1.0, 9: 50.0}, repetition_penalty=2.0, temperature=0.0)
    # token 0: 2 - 3 = -1; token 2: (1 + 1) / 2 = 1 (penalised after the bias); id 9 is past the vocab.
    assert processed_logits(logits, [row]).tolist() == [[-1.0, -2.0, 1.0, 0.5]]


def test_logit_bias_changes_greedy_picks_and_the_sampler_leaves_its_fast_path_for_it():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    rows = [make_row(temperature=0.0), make_row(temperature=0.0, logit_bias={2: 100.0})]
    assert Sampler()(logits, rows).token_ids == [0, 2]
    banned = [make_row(temperature=1.0, seed=seed, logit_bias={0: -100.0, 1: -100.0}) for seed in range(20)]
    assert set(Sampler()(logits[:1].expand(20, 3), banned).token_ids) == {2}


# --- hand-built distributions ----------------------------------------------------------------------

@pytest.mark.parametrize("top_p, expected", [(0.8, [0, 1]), (0.81, [0, 1, 2]), (0.5, [0]), (0.51, [0, 1]),
                                             (1e-6, [0]), (0.999, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_top_set_with_mass_at_least_p(top_p, expected):
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    assert kept(processed_logits(logits, [make_row(top_p=top_p)])[0]) == expected


def test_top_p_keeps_top_token_even_when_it_alone_exceeds_p_and_ignores_order_of_ids():
    logits = logits_for([0.05, 0.9, 0.05])
    assert kept(processed_logits(logits, [make_row(top_p=0.01)])[0]) == [1]


@pytest.mark.parametrize("min_p, expected", [(0.45, [0, 1]), (0.39, [0, 1, 2]), (0.11, [0, 1, 2]),
                                             (0.09, [0, 1, 2, 3]), (1.0, [0])])
def test_min_p_keeps_tokens_with_probability_at_least_min_p_times_max(min_p, expected):
    logits = logits_for([0.5, 0.25, 0.2, 0.05])
    assert kept(processed_logits(logits, [make_row(min_p=min_p)])[0]) == expected


@pytest.mark.parametrize("top_k, expected", [(1, [0]), (2, [0, 1, 2, 4]), (4, [0, 1, 2, 4]),
                                             (5, [0, 1, 2, 3, 4]), (50, [0, 1, 2, 3, 4])])
def test_top_k_keeps_every_token_tied_with_the_kth(top_k, expected):
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, 1.0]])
    assert kept(processed_logits(logits, [make_row(top_k=top_k)])[0]) == expected


def test_temperature_divides_and_filters_compose_in_order():
    # temperature 0.5 doubles the logits exactly, then top_k=3 drops the smallest.
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    processed = processed_logits(logits, [make_row(temperature=0.5, top_k=3)])[0]
    assert processed.tolist() == [2.0, 1.0, 0.0, float("-inf")]


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.0]])
    row = make_row(prompt=[0, 4], output=[1, 1], repetition_penalty=2.0, temperature=0.0)
    # Seen tokens 0, 1, 4: positive divided, negative multiplied, zero stays zero; each counted once.
    assert processed_logits(logits, [row]).tolist() == [[1.0, -4.0, 1.0, -1.0, 0.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.ones(1, 5)
    row = make_row(prompt=[0, 3, 3], output=[1, 2, 2, 2], presence_penalty=0.5, frequency_penalty=0.25,
                   temperature=0.0)
    # id 1: 1 - (0.5 + 0.25 * 1); id 2: 1 - (0.5 + 0.25 * 3); prompt ids 0 and 3 untouched.
    assert processed_logits(logits, [row]).tolist() == [[1.0, 0.25, -0.25, 1.0, 1.0]]


def test_negative_presence_and_frequency_penalties_encourage_repeats():
    logits = torch.zeros(1, 3)
    row = make_row(output=[2, 2], presence_penalty=-1.0, frequency_penalty=-0.5, temperature=0.0)
    assert processed_logits(logits, [row]).tolist() == [[0.0, 0.0, 2.0]]


def test_rows_only_get_their_own_penalties():
    logits = torch.ones(3, 4)
    rows = [make_row(output=[0], presence_penalty=1.0, temperature=0.0),
            make_row(output=[1], temperature=0.0),
            make_row(output=[2], frequency_penalty=2.0, temperature=0.0)]
    assert processed_logits(logits, rows).tolist() == [[0.0, 1.0, 1.0, 1.0], [1.0] * 4, [1.0, 1.0, -1.0, 1.0]]


# --- greedy and min_tokens -------------------------------------------------------------------------

def test_greedy_picks_argmax_and_breaks_ties_to_lowest_id():
    logits = torch.tensor([[0.1, 0.9, 0.3], [0.5, 0.2, 0.5], [-1.0, -1.0, -1.0]])
    rows = [make_row(temperature=0.0) for _ in range(3)]
    assert Sampler()(logits, rows).token_ids == [1, 0, 0]


def test_greedy_follows_penalised_logits():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    row = make_row(prompt=[0], repetition_penalty=2.0, temperature=0.0)
    assert Sampler()(logits, [row]).token_ids == [1]


def test_min_tokens_masks_stop_ids_until_the_boundary():
    eos, stop = 3, 1
    logits = torch.tensor([[0.0, 8.0, 1.0, 9.0]])
    chosen = []
    for generated in range(4):
        row = make_row(output=[2] * generated, stop_ids=(eos, stop), min_tokens=2, stop_token_ids=[stop],
                       temperature=0.0)
        chosen.append(Sampler()(logits, [row]).token_ids[0])
    assert chosen == [2, 2, eos, eos]


def test_all_plain_greedy_batch_takes_the_fast_path(monkeypatch):
    def fail(*args):
        raise AssertionError("fast path must not process logits row by row")

    monkeypatch.setattr(sampler_module, "processed_logits", fail)
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    rows = [make_row(temperature=0.0, min_tokens=1, output=[5]) for _ in range(6)]  # min_tokens already met
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


# --- seeded draws ------------------------------------------------------------------------------------

def test_row_generator_seed_is_splitmix64():
    # mix64(0) == 0, so seed 0 gives the reference SplitMix64 stream from state 0.
    assert [row_generator_seed(0, p) for p in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                            0x06C45D188009454F]
    seeds = {row_generator_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500


def test_seeded_draw_ignores_batch_composition_and_sampler_state():
    vocab = 97
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(11))
    others = torch.randn(3, vocab, generator=torch.Generator().manual_seed(12))
    filler = [make_row(temperature=0.0), make_row(seed=777, output=[1]), make_row(top_k=5)]
    for seed in range(24):
        row = make_row(seed=seed, output=[4, 4, 4], top_p=0.9, repetition_penalty=1.2)
        alone = Sampler(seed=0)(logits, [row]).token_ids[0]
        first = Sampler(seed=1)(torch.cat([logits, others]), [row, *filler]).token_ids[0]
        used = Sampler(seed=2)
        used(others, filler)  # advances the unseeded stream; must not matter
        last = used(torch.cat([others, logits]), [*filler, row]).token_ids[-1]
        assert alone == first == last


def test_seeded_draws_at_consecutive_positions_are_independent():
    vocab, positions = 8, 4000
    logits = torch.zeros(positions, vocab)  # uniform
    rows = [make_row(seed=5, output=[0] * position, max_tokens=positions + 1)
            for position in range(positions)]
    draws = torch.tensor(Sampler()(logits, rows).token_ids)
    frequencies = torch.bincount(draws, minlength=vocab).float() / positions
    assert torch.all((frequencies - 1 / vocab).abs() < 0.025)
    repeats = (draws[1:] == draws[:-1]).float().mean().item()
    assert abs(repeats - 1 / vocab) < 0.025  # correlated positions would repeat far more (or less) often


# --- sampling matches the processed distribution ---------------------------------------------------

def _draw_frequencies(seeded: bool, draws: int = 4000):
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(21)) * 2
    params = dict(temperature=0.7, top_k=6, top_p=0.9, repetition_penalty=1.1)
    rows = [make_row(prompt=[0, 1], seed=(i if seeded else None), **params) for i in range(draws)]
    tokens = torch.tensor(Sampler(seed=9)(logits.expand(draws, -1), rows).token_ids)
    expected = processed_logits(logits, rows[:1])[0].softmax(dim=-1)
    return torch.bincount(tokens, minlength=16).float() / draws, expected


@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_frequencies_match_processed_distribution(seeded):
    observed, expected = _draw_frequencies(seeded)
    assert torch.all(observed[expected == 0] == 0)  # filtered tokens are never drawn
    assert (expected > 0).sum() >= 3  # the check below compares a real distribution
    assert torch.all((observed - expected).abs() < 0.03)


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(64, 1000)
    rows = [make_row() for _ in range(64)]
    assert Sampler(seed=4)(logits, rows).token_ids == Sampler(seed=4)(logits, rows).token_ids
    assert Sampler(seed=4)(logits, rows).token_ids != Sampler(seed=5)(logits, rows).token_ids


# --- logprobs and the caller's tensor --------------------------------------------------------------

def test_logprobs_come_from_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(8))
    rows = [make_row(logprobs=5, temperature=0.5, presence_penalty=1.0, output=[1, 2], seed=1),
            make_row(temperature=0.0),
            make_row(logprobs=0, temperature=0.0, repetition_penalty=1.5, prompt=[3])]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs[1] is None and out.logprobs[2].top == ()
    for i in (0, 2):
        assert out.logprobs[i].sampled_logprob == raw[i, out.token_ids[i]].item()
    top = out.logprobs[0].top
    expected_values, expected_ids = raw[0].topk(5)
    assert [token_id for token_id, _ in top] == expected_ids.tolist()
    assert [value for _, value in top] == expected_values.tolist()
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_callers_logits_are_not_modified_even_as_a_view():
    storage = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    logits = storage[::2]  # a non-contiguous view
    before = storage.clone()
    rows = [make_row(repetition_penalty=1.5, prompt=[1, 2], temperature=0.0),
            make_row(output=[0], min_tokens=3, stop_ids=(0, 1), presence_penalty=0.5, top_k=3, seed=1),
            make_row(top_p=0.5, min_p=0.1, temperature=2.0),
            make_row(temperature=0.0, logprobs=3)]
    Sampler()(logits, rows)
    processed_logits(logits, rows)
    assert torch.equal(storage, before)


def test_bfloat16_logits_are_processed_in_float32():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    processed = processed_logits(logits, [make_row(temperature=0.5)])
    assert processed.dtype == torch.float32 and processed.tolist() == [[2.0, 4.0, 6.0]]


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(torch.zeros(3, 10), [make_row(), make_row()])


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []
