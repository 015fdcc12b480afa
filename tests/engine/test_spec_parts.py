"""The parts of speculative decoding, exactly: config validation, prompt lookup, the adaptive switch's
rule (fed exact costs), the KV table rollback; and the switch turning itself off in a real engine."""

from __future__ import annotations

import math

import pytest

from engine import SamplingParams
from engine.kv_cache_manager import KVCacheManager
from engine.speculative.adaptive import (
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    PROBE_STEPS,
    PROBE_TIME_SHARE,
    AdaptiveSwitch,
)
from engine.speculative.catch_up import STALL_FACTOR
from engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from engine.speculative.ngram import NgramProposer
from tests.factories import TinySpec, random_prompts


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"method": "medusa"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model"),
        ({"model": "x", "quantization": "int3"}, "speculative_config.quantization"),
        ({"method": "ngram", "quantization": "int8"}, "speculative_config.quantization"),
        ({"k": 3}, "unknown key"),
    ],
)
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(SpeculativeConfigError, match=key):
        SpeculativeConfig.from_dict(raw)


def test_a_model_implies_the_draft_model_method():
    assert SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 2}).method == "draft_model"


def test_prompt_lookup_takes_the_longest_latest_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == (7, 8, 5)  # "2 3" latest at 5
    assert proposer.propose([1, 2, 3, 4, 5], 3) == ()  # 5 never occurred before
    assert proposer.propose([4, 1, 2, 4], 2) == (1, 2)
    assert proposer.propose([4, 1, 2, 4], 0) == ()


def _switch_after(spec_cost_s: float, plain_cost_s: float, batch: int, steps: int = 200) -> list[bool]:
    switch, decisions = AdaptiveSwitch(), []
    for _ in range(steps):
        on = switch.decide(batch)
        decisions.append(on)
        switch.observe(on, batch, (spec_cost_s if on else plain_cost_s) * batch, batch)
    return decisions


def test_switch_turns_off_when_speculation_costs_more_per_token():
    # A large batch (compute-bound) or low acceptance: a speculative step costs more per token.
    decisions = _switch_after(spec_cost_s=0.012, plain_cost_s=0.010, batch=64, steps=600)
    assert decisions[: 2 * PROBE_STEPS] == [False] * PROBE_STEPS + [True] * PROBE_STEPS  # both modes measured
    settled = decisions[200:]  # probe intervals have doubled past 128 steps by now
    assert settled.count(True) <= PROBE_STEPS * (len(settled) // 128 + 1)  # only the probes


def test_a_costly_loser_is_probed_rarely():
    """Speculation 8x dearer per token: a probe costs 3 steps x 7 extra; under PROBE_TIME_SHARE (2%) of
    the time that is one probe per 1,050 steps once both windows are full (after the probes at 16, 48
    and 112 steps), where doubling alone would probe at 240, 496, 1008 and 2032 too."""
    decisions = _switch_after(spec_cost_s=0.08, plain_cost_s=0.01, batch=64, steps=3000)
    assert decisions[: 2 * PROBE_STEPS] == [False] * PROBE_STEPS + [True] * PROBE_STEPS
    assert decisions[200:].count(True) <= 2 * PROBE_STEPS
    assert math.ceil(PROBE_STEPS * 7 / PROBE_TIME_SHARE) == 1050 <= MAX_PROBE_INTERVAL


def test_the_probe_budget_is_not_recomputed_on_every_step(monkeypatch):
    """Between probes a step's decision is O(1): the budget (which walks both windows) is worked out
    when the probe interval is reached and again only when its own count is reached, not on every step
    in between (it was, at ~10 us a step, 2-5% of a batch-1 GPU step). The probes still come when the
    budget says: test_a_costly_loser_is_probed_rarely."""
    import engine.speculative.adaptive as adaptive

    calls = []
    budget = adaptive._budget_interval
    monkeypatch.setattr(adaptive, "_budget_interval", lambda *a: calls.append(1) or budget(*a))
    decisions = _switch_after(spec_cost_s=0.08, plain_cost_s=0.01, batch=64, steps=3000)
    probes = sum(1 for i in range(1, 3000) if decisions[i] and not decisions[i - 1])
    assert probes >= 2 and len(calls) <= 3 * probes


def _switch_with_drafts(step_s, batch: int, k: int, accepted: int, steps: int, catch_up_s: float = 0.0):
    """Decisions of a switch fed steps of `step_s(on)` seconds; a speculative step emits (1 + accepted)
    tokens per sequence of at most 1 + k; `catch_up_s` > 0: the draft model must catch up on the first
    speculative step after plain ones, a step that long."""
    switch, decisions, behind = AdaptiveSwitch(), [], True
    for _ in range(steps):
        on = switch.decide(batch)
        decisions.append(on)
        if on and behind and catch_up_s:
            switch.observe(True, batch, catch_up_s, batch, batch * (1 + k), catch_up=True)
        elif on:
            switch.observe(True, batch, step_s(True), batch * (1 + accepted), batch * (1 + k))
        else:
            switch.observe(False, batch, step_s(False), batch)
        behind = not on
    return decisions


def test_a_hopeless_speculation_is_dropped_after_one_step():
    """A compute-bound batch: a verify step over 1 + 4 tokens per sequence costs 6x a plain step, so even
    five tokens per sequence would cost more than plain ones, whatever the acceptance. One speculative
    sample shows it; the first probe stops there, and so does every later one."""
    for accepted in (4, 0):
        decisions = _switch_with_drafts(lambda on: 6.0 if on else 1.0, batch=64, k=4, accepted=accepted, steps=3000)
        assert decisions[: PROBE_STEPS + 2] == [False] * PROBE_STEPS + [True, False]
        probes = [i for i in range(1, 3000) if decisions[i] and not decisions[i - 1]]
        assert all(not decisions[i + 1] for i in probes)  # one step each
        assert len(probes) <= 8  # doubling from 16 steps, or the time budget where it is longer
    # Nothing accepted: a probe step costs 5 plain steps more than its 64 tokens do; 2% of the time
    # allows one every 250 steps.
    late = [i for i in range(600, 3000) if decisions[i]]
    assert all(b - a >= 250 for a, b in zip(late, late[1:]))


def test_a_costly_catch_up_spaces_the_probes_out():
    """A draft as big as the target: low acceptance makes speculation lose, and every probe first
    catches the draft up on the steps it skipped, a step 40x a plain one. The probes' spacing counts
    that step: at most 2% of the time goes to probing."""
    decisions = _switch_with_drafts(
        lambda on: 2.0 if on else 1.0, batch=8, k=4, accepted=0, steps=3000, catch_up_s=40.0
    )
    probe_starts = [i for i in range(1, 3000) if decisions[i] and not decisions[i - 1]]
    settled = [i for i in probe_starts if i > 200]
    assert all(b - a >= 2000 for a, b in zip(settled, settled[1:])) and len(settled) <= 2
    cost = sum(2.0 if on else 1.0 for on in decisions) + 40.0 * len(probe_starts)
    assert cost < 1.1 * 3000  # plain all along would cost 3000


def test_a_draft_that_could_win_is_dropped_once_its_acceptance_is_known():
    """Speculation costing 1.5x a plain step could win at full acceptance (5 tokens for 1.5): not
    hopeless on the first sample (32 drafts judged, too few for a rate). With nothing accepted, the
    second sample brings the rate (0 of 64) and shows it cannot win: off after two speculative steps."""
    decisions = _switch_with_drafts(lambda on: 1.5 if on else 1.0, batch=8, k=4, accepted=0, steps=100)
    assert decisions[: PROBE_STEPS + 3] == [False] * PROBE_STEPS + [True, True, False]
    assert decisions[PROBE_STEPS + 2 : PROBE_STEPS + 12] == [False] * 10


def test_the_acceptance_rate_is_shared_by_buckets():
    """A batch of 2 learns that nothing is accepted; a batch of 8 then needs one speculative step to see
    that speculation cannot pay there either, where it would otherwise take PROBE_STEPS."""
    switch = AdaptiveSwitch()
    for _ in range(200):  # 3 speculative samples, then probes: 8 drafts each
        on = switch.decide(2)
        switch.observe(on, 2, 1.2 if on else 1.0, 2, 2 * 5 if on else None)
    assert switch.acceptance_rate() == 0.0
    decisions = []
    for _ in range(PROBE_STEPS + 3):
        on = switch.decide(8)
        decisions.append(on)
        switch.observe(on, 8, 1.2 if on else 1.0, 8, 8 * 5 if on else None)
    assert decisions == [False] * PROBE_STEPS + [True, False, False]


def test_one_stalled_step_does_not_flip_the_decision():
    switch, batch = AdaptiveSwitch(), 1
    decisions = []
    for step in range(100):
        on = switch.decide(batch)
        decisions.append(on)
        stalled = step == 40  # the host stalled the process for one step
        switch.observe(on, batch, 1.0 if stalled else (0.004 if on else 0.010), batch)
    assert all(decisions[41:52])  # the stalled step (the window's slowest) is left out
    assert decisions[2 * PROBE_STEPS :].count(False) <= 2 * PROBE_STEPS  # the two probes only


def test_switch_stays_on_when_speculation_is_cheaper_and_buckets_are_separate():
    assert _switch_after(spec_cost_s=0.004, plain_cost_s=0.010, batch=1)[50:].count(False) <= 2 * PROBE_STEPS
    switch = AdaptiveSwitch()
    for _ in range(2 * PROBE_STEPS):  # batch 64 learns that speculation loses; batch 1 has measured nothing
        on = switch.decide(64)
        switch.observe(on, 64, 2.0 if on else 1.0, 64)
    assert switch.decide(64) is False
    assert switch.decide(1) is False  # batch 1 starts with plain samples of its own
    assert switch.costs(64) == (2.0 / 64, 1.0 / 64) and switch.costs(1) == (None, None)


def test_lumpy_acceptance_is_judged_by_what_the_tokens_cost():
    """Steps accept all 4 drafts or none: 3 in 5 speculative steps emit 1 token, 2 emit 5, each costing
    1.3x a plain step. The typical (median) step loses at 1.3 s per token, but the tokens cost
    (5 x 1.3 s) / 13 = 0.5 s each against plain's 1.0 s (about 0.6 s within an 8-step window that
    drops its slowest step): speculate."""
    switch, batch, step = AdaptiveSwitch(), 1, 0
    decisions = []
    for _ in range(120):
        on = switch.decide(batch)
        decisions.append(on)
        tokens = (5 if step % 5 in (1, 3) else 1) if on else 1
        step += on
        switch.observe(on, batch, 1.3 if on else 1.0, tokens)
    assert switch.costs(batch)[0] < 0.7 and switch.costs(batch)[1] == 1.0
    assert decisions[2 * PROBE_STEPS :].count(False) <= 3 * PROBE_STEPS  # plain only in probes


def test_switch_follows_a_drop_in_acceptance():
    switch, batch = AdaptiveSwitch(), 4
    for _ in range(40):  # high acceptance: speculation wins
        on = switch.decide(batch)
        switch.observe(on, batch, 0.01, batch * (3 if on else 1))
    assert switch.decide(batch) is True
    decisions = []
    for _ in range(8 * FIRST_PROBE_INTERVAL):  # acceptance falls to zero: one token per sequence
        on = switch.decide(batch)
        decisions.append(on)
        switch.observe(on, batch, 0.02 if on else 0.01, batch)
    assert decisions[-64:].count(True) <= PROBE_STEPS


def test_steps_that_cannot_be_measured_speculate_only_where_it_pays():
    """A prompt chunk due (a batch ramping up): no cost sample can come of the step, so an unmeasured
    bucket does not spend a probe on it; a bucket measured cheaper with speculation keeps it on."""
    switch = AdaptiveSwitch()
    assert switch.decide(8, measurable=False) is False
    assert switch.decide(8) is False  # a measurable step starts the bucket's measurements, plain first
    for _ in range(PROBE_STEPS):
        switch.observe(False, 8, 0.010, 8)
    assert switch.decide(8) is True and switch.decide(8, measurable=False) is False
    for _ in range(2 * PROBE_STEPS):
        on = switch.decide(1)
        switch.observe(on, 1, 0.004 if on else 0.010, 1)
    assert switch.decide(1, measurable=False) is True


def test_disabled_switch_always_speculates():
    switch = AdaptiveSwitch(enabled=False)
    switch.observe(True, 1, 100.0, 1)
    assert switch.decide(1) is True


def test_truncate_frees_emptied_blocks_and_keeps_registered_ones():
    kv = KVCacheManager(8, block_size=2)
    kv.allocate("s", 7)  # 4 blocks
    kv.truncate("s", 3)  # 2 blocks cover 3 tokens
    assert len(kv.block_table("s")) == 2 and kv.num_free_blocks == 6
    kv.check_integrity()
    kv.free("s")
    assert kv.num_free_blocks == 8


def test_engine_switches_off_a_draft_that_is_never_accepted(checkpoint, make_llm):
    """A draft model that disagrees with the target: every speculative step costs k + 1 forwards
    for about one token, so the measured rule turns speculation off after its first measurements."""
    model_dir = checkpoint(TinySpec())
    draft = checkpoint(TinySpec(num_layers=1, seed=77))
    llm = make_llm(model_dir, num_kv_blocks=256, speculative_config={"model": str(draft), "num_speculative_tokens": 6})
    prompts = random_prompts(1, 8, 8, 512, seed=3)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True), use_tqdm=False)
    counters = llm.engine.spec.counters
    assert counters.accepted_tokens < counters.draft_tokens / 3  # the draft is a poor one
    assert counters.steps_off > 3 * counters.steps_on


def test_engine_config_takes_the_dict_and_refuses_the_prefill_role():
    from engine.config import EngineConfig

    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(role="prefill", speculative_config={"method": "ngram"})


def _brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            return tuple(tokens[starts[-1] + n : starts[-1] + n + k])
    return ()


def test_prompt_lookup_equals_a_brute_force_search():
    import random

    rng = random.Random(7)
    for trial in range(400):
        # Few distinct values so n-grams recur; large ids so byte patterns straddle token boundaries.
        values = [rng.randrange(3), rng.randrange(3) << 40, 1 + (1 << 8), 256, 2**62 + rng.randrange(2)]
        tokens = [rng.choice(values) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 3)
        max_n = min_n + rng.randrange(0, 4)
        k = rng.randrange(0, 6)
        want = _brute_force_lookup(tokens, min_n, max_n, k) if k and len(tokens) >= min_n + 1 else ()
        assert NgramProposer(min_n, max_n).propose(tokens, k) == want, (tokens, min_n, max_n, k)


def test_prompt_lookup_ignores_byte_matches_across_token_boundaries():
    a, b = 0x11 << 56, 0x22  # little-endian bytes: ... 00 11 | 22 00 ...
    x = 0x0000002211000000  # = the 8 bytes straddling a and b
    assert NgramProposer(1, 1).propose([a, b, 5, x], 2) == ()
    assert NgramProposer(1, 1).propose([x, 9, a, b, 5, x], 2) == (9, a)


def test_a_step_that_caught_the_draft_up_is_a_cost_of_speculation():
    """The draft's KV of a new prompt (or of steps run without speculation) is computed on the next
    speculative step: plain decoding never pays it, so it is part of what speculation costs, and it is
    never dropped as the window's outlier."""
    from types import SimpleNamespace

    from engine.sampler import Sampler
    from engine.speculative.decoder import SpeculativeDecoder

    draft = SimpleNamespace(caught_up=True, caught_up_tokens=0, caught_up_seqs=[])
    decoder = SpeculativeDecoder(SpeculativeConfig(method="draft_model", model="d"), Sampler(), 64, draft)
    running = [SimpleNamespace(num_uncomputed_tokens=1)]
    chunk = SimpleNamespace(num_new_tokens=5, draft_token_ids=(1, 2, 3, 4))
    for _ in range(PROBE_STEPS):
        decoder.switch.observe(False, 1, 0.010, 1)
    assert decoder.lookahead(running) == 4  # measured plain, not yet speculation: probe it
    decoder.observe([chunk], 5, 5)
    spec_cost, _ = decoder.switch.costs(1)
    assert spec_cost is not None and spec_cost > 0
    switch = AdaptiveSwitch()
    switch.observe(True, 1, 0.100, 5, 5, catch_up=True)  # the slowest step, but a catch-up: kept
    for _ in range(3):
        switch.observe(True, 1, 0.012, 5, 5)
    switch.observe(True, 1, 0.050, 5, 5)  # a stalled ordinary step: left out
    assert switch.costs(1)[0] == pytest.approx((0.100 + 3 * 0.012) / 20)


def test_a_draft_that_wins_per_step_but_must_keep_catching_up_is_turned_off():
    """A level draft's step is slightly cheaper per token than plain decoding, but every speculative
    step after plain ones first computes the KV the draft lacks (a batch of new prompts: 30 plain
    steps' worth). Counting that step as speculation's cost keeps the bucket on plain decoding, and
    the probes' spacing counts the catch-up from its first measurement: 29 steps' extra under 2% of
    the time is one probe per 1,450 steps, not the doubling schedule's 16, 48 and 112."""
    decisions = _switch_with_drafts(lambda on: 3.6 if on else 1.0, batch=64, k=4, accepted=3, steps=3000,
                                    catch_up_s=30.0)
    assert decisions[: PROBE_STEPS + 1] == [False] * PROBE_STEPS + [True]  # measured, with its catch-up
    assert decisions[2 * PROBE_STEPS : 1400].count(True) == 0
    assert decisions[1400:].count(True) <= 2 * PROBE_STEPS


def test_a_stalled_catch_up_is_charged_what_its_tokens_usually_cost():
    """Measured on an H200: a batch-1 catch-up step at a new prompt length took 48 ms where catch-ups of
    similar length took ~3 ms. Charged in full it made speculation (0.37 ms per token level, against
    0.65 ms plain) read several times dearer and stay off; charged the level step plus the usual rate
    per caught-up token, the switch keeps speculating. A catch-up that costs what its tokens should,
    however long, is charged in full."""
    switch = AdaptiveSwitch()
    for _ in range(PROBE_STEPS):
        switch.observe(False, 1, 0.00065, 1)
    switch.observe(True, 1, 0.0032, 5, 5, catch_up=True, catch_up_tokens=145)  # a new prompt's catch-up
    for _ in range(3):
        switch.observe(True, 1, 0.0018, 5, 5)
    switch.observe(True, 1, 0.048, 5, 5, catch_up=True, catch_up_tokens=245)  # the stall
    usual = (0.0032 - 0.0018) / 145  # the first catch-up re-rated against the level step
    assert STALL_FACTOR * usual < (0.048 - 0.0018) / 245
    spec_s, plain_s = switch.costs(1)
    # The window's slowest ordinary step (one of the equal level steps) is left out, as always.
    assert spec_s == pytest.approx((0.0032 + 2 * 0.0018 + 0.0018 + usual * 245) / 20)
    assert spec_s < plain_s and switch.decide(1)
    genuine = AdaptiveSwitch()
    genuine.observe(True, 1, 0.0032, 5, 5, catch_up=True, catch_up_tokens=145)
    genuine.observe(True, 1, 0.0018, 5, 5)
    dear = 0.0018 + 3 * (0.0032 - 0.0018) * 40  # 40x the tokens at 3x the usual rate: not a stall
    genuine.observe(True, 1, dear, 5, 5, catch_up=True, catch_up_tokens=145 * 40)
    assert genuine.costs(1)[0] == pytest.approx((0.0032 + dear) / 10)  # in full (the level step is the outlier)


def test_a_catch_up_is_spread_over_the_tokens_it_enables():
    """Measured on an H200 (bf16, batch 1, 128-token outputs): plain steps 0.66 ms; a draft that
    accepts ~97% makes level speculative steps of 1.8 ms for 5 tokens; its catch-up over a new prompt
    took ~11 ms. Judged over a probe's three steps that read 0.97 ms per token and kept the draft off;
    spread over the ~127 tokens the sequence still emits it adds ~0.07 ms, and the switch speculates.
    The same catch-up ahead of 2 tokens per sequence stays a reason to decode plainly."""
    def run(tokens_ahead: int) -> tuple[list[bool], AdaptiveSwitch]:
        switch, decisions, behind = AdaptiveSwitch(), [], True
        for _ in range(200):
            on = switch.decide(1)
            decisions.append(on)
            if on and behind:
                switch.observe(True, 1, 0.011, 5, 5, catch_up=True, catch_up_tokens=150, tokens_ahead=tokens_ahead)
            elif on:
                switch.observe(True, 1, 0.0018, 5, 5)
            else:
                switch.observe(False, 1, 0.00066, 1)
            behind = not on
        return decisions, switch

    spread, switch = run(tokens_ahead=127)
    assert spread[:PROBE_STEPS] == [False] * PROBE_STEPS and spread[50:].count(False) <= 2 * PROBE_STEPS
    spec_s, plain_s = switch.costs(1)
    assert spec_s == pytest.approx(0.0018 / 5 + (0.011 - 0.0018) / 127)  # level + surcharge
    assert spec_s < plain_s
    short, _ = run(tokens_ahead=2)
    assert short[50:].count(True) <= PROBE_STEPS  # (9.2 ms / 2 tokens): plain, bar a probe


def test_the_decoder_expects_max_tokens_or_the_typical_output_ahead():
    from types import SimpleNamespace

    from engine.sampler import Sampler
    from engine.speculative.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram"), Sampler(), 64)

    def seq(max_tokens, done, ignore_eos=False):
        params = SimpleNamespace(max_tokens=max_tokens, ignore_eos=ignore_eos)
        return SimpleNamespace(params=params, num_output_tokens=done)

    assert decoder._tokens_ahead([seq(100, 10), seq(20, 5)]) == 90 + 15  # nothing finished yet: max_tokens
    for length in (30, 40, 50):
        decoder.finished(seq(100, length))
    assert decoder._tokens_ahead([seq(100, 10)]) == 30  # the median finished output (40), less 10 done
    assert decoder._tokens_ahead([seq(100, 10, ignore_eos=True)]) == 90  # EOS cannot end it early
    assert decoder._tokens_ahead([seq(100, 60)]) == 1  # past the typical length: at least one more
