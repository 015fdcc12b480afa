"""Engine behaviour beyond greedy exactness: seeded sampling, stop conditions, logprobs, bad input,
abort, priorities, and the prefill/decode roles that disaggregation builds on."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.sequence import FinishReason
from tests.conftest import assert_engine_clean
from tests.factories import TinySpec, hf_greedy_generate, random_prompts


def _tokens(outputs):
    return [list(o.token_ids) for o in outputs]


def test_seeded_sampling_is_independent_of_batch_composition(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(4, 5, 40, 512, seed=51)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _tokens(make_llm(model_dir).generate(prompts[:1], seeded, use_tqdm=False))
    others = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=99, max_tokens=5, ignore_eos=True)]
    mixed = make_llm(model_dir, prefill_chunk_tokens=7).generate(
        prompts[1:] + prompts[:1], others + [seeded], use_tqdm=False)
    assert _tokens(mixed)[-1] == alone[0]
    different_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=4321,
                                    ignore_eos=True)
    assert _tokens(make_llm(model_dir).generate(prompts[:1], different_seed, use_tqdm=False)) != alone


def test_seeded_sampling_survives_preemption(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(8, 10, 40, 512, seed=52)
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=s, ignore_eos=True) for s in range(8)]
    roomy = _tokens(make_llm(model_dir).generate(prompts, params, use_tqdm=False))
    tight = make_llm(model_dir, block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == roomy


def test_stop_token_ids_eos_and_max_tokens(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompt = random_prompts(1, 10, 10, 512, seed=53)[0]
    reference = hf_greedy_generate(model_dir, [prompt], 12)[0]
    llm = make_llm(model_dir)
    stop_at = reference[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    assert list(out.token_ids) == reference[: reference.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    # the stop token's id is returned, its text only on request (as vLLM renders it)
    tokenizer = llm.tokenizer
    assert out.text == tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    shown = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                  include_stop_str_in_output=True), use_tqdm=False)[0]
    assert shown.token_ids == out.token_ids and shown.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                min_tokens=12, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_eos_ends_generation_unless_ignored(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    prompt = random_prompts(1, 10, 10, 512, seed=54)[0]
    reference = hf_greedy_generate(model_dir, [prompt], 12)[0]
    eos = reference[3]  # pretend this token is EOS for this engine
    llm.engine.stops.eos_token_ids = frozenset({eos})
    llm.engine.model_config = llm.engine.model_config.__class__(
        **{**llm.engine.model_config.__dict__, "eos_token_ids": (eos,)})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert list(out.token_ids) == reference[: reference.index(eos) + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.token_ids) == reference


def test_stop_string_cuts_text_and_ends_sequence(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    prompt = random_prompts(1, 10, 10, 512, seed=55)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len(full.text) > 4
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert list(out.token_ids) == list(full.token_ids[: len(out.token_ids)])


def test_logprobs_are_raw_model_logprobs(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    prompt = random_prompts(1, 8, 8, 512, seed=56)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        assert len(entry.top) == 4 and entry.top[0][0] == token  # greedy: the sampled token is the best
        assert entry.sampled_logprob == pytest.approx(entry.top[0][1])
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))


def test_timings_are_reported(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()))
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.ttft_s > 0 and out.metrics.tpot_s > 0
    assert len(out.metrics.token_times_s) == 5 and len(out.metrics.inter_token_latencies_s) == 4


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt"),
    ("", SamplingParams(), "prompt"),
    ([7] * 600, SamplingParams(), "prompt"),  # over max_position_embeddings=512
    ([1, 2, 100000], SamplingParams(), "prompt_token_ids"),
    ([1, -3], SamplingParams(), "prompt_token_ids"),
    ([1, 2], SamplingParams(stop_token_ids=[99999]), "stop_token_ids"),
    ([1, 2], SamplingParams(logit_bias={5: 1.0, 99999: -1.0}), "logit_bias"),
])
def test_bad_requests_name_the_problem_and_do_not_disturb_others(prompt, params, field, checkpoint,
                                                                 make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    good = random_prompts(2, 5, 20, 512, seed=57)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = llm.engine
    engine.add_request("good-0", good[0], greedy)
    engine.step()  # good-0 is mid-flight when the bad request arrives
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([good[1], prompt], [greedy, params], use_tqdm=False)
    assert err.value.field == field and field in str(err.value)
    assert not engine.kv.has("offline-0"), "the good request of the rejected batch was not rolled back"
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished("good-0").output_token_ids == hf_greedy_generate(model_dir, good[:1], 8)[0]
    assert _tokens(llm.generate([good[1]], greedy, use_tqdm=False)) == hf_greedy_generate(
        model_dir, good[1:], 8)


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=0), "top_k"), (dict(logprobs=21), "logprobs"), (dict(temperature=float("nan")), "temperature"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"),
    (dict(logit_bias={5: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "logit_bias"), (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_unknown_architecture_and_missing_files_are_named(checkpoint, tmp_path):
    import json
    import shutil

    from engine import LLM

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint(TinySpec()), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(model_dir, progress=False)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="model.safetensors"):
        LLM(model_dir, progress=False)
    with pytest.raises(UnsupportedModelError, match="config.json"):
        LLM(tmp_path / "nowhere", progress=False)


def test_abort_frees_blocks_and_others_finish(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    engine = llm.engine
    prompts = random_prompts(3, 20, 40, 512, seed=58)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, greedy)
    engine.step()
    assert engine.abort_request("r1") and not engine.abort_request("r1")
    while engine.has_unfinished():
        engine.step()
    expected = hf_greedy_generate(model_dir, [prompts[0], prompts[2]], 10)
    assert [engine.pop_finished(r).output_token_ids for r in ("r0", "r2")] == expected


def test_higher_priority_runs_first_and_fcfs_within_priority(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()), max_num_seqs=1)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for name, priority in [("low-a", 0), ("high-a", 5), ("low-b", 0), ("high-b", 5)]:
        engine.add_request(name, [1, 2, 3], greedy, priority=priority)
    order = []
    while engine.has_unfinished():
        order += [u.seq_id for u in engine.step() if u.finish_reason is not None]
    assert order == ["high-a", "high-b", "low-a", "low-b"]
    for name in order:
        engine.pop_finished(name)


def test_prefill_role_hands_blocks_to_a_decode_role_engine(checkpoint, make_llm):
    """Prefill here, decode there: copying the handed-off blocks into the decode engine's reserved
    blocks continues the sequence exactly as the colocated engine does."""
    model_dir = checkpoint(TinySpec(num_kv_heads=2))
    prompts = random_prompts(3, 5, 50, 512, seed=59)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prefill = make_llm(model_dir, role="prefill").engine
    decode = make_llm(model_dir, role="decode", block_size=16).engine
    for index, prompt in enumerate(prompts):
        prefill.add_request(f"r{index}", prompt, greedy)
    handed = []
    while prefill.has_unfinished():
        handed += [u.seq_id for u in prefill.step() if u.finish_reason is FinishReason.HANDOFF]
    for seq_id in handed:
        handoff = prefill.handoff_blocks(seq_id)
        assert handoff.num_computed_tokens == len(handoff.token_ids) - 1
        target = decode.reserve(seq_id, handoff.num_computed_tokens)
        decode.runner.kv_cache.copy_blocks_from(prefill.runner.kv_cache, handoff.block_ids, target)
        prefill.release(seq_id)
        decode.adopt(seq_id, handoff.token_ids, len(handoff.token_ids) - 1, greedy)
    while decode.has_unfinished():
        decode.step()
    got = [decode.pop_finished(f"r{i}").output_token_ids for i in range(3)]
    assert got == hf_greedy_generate(model_dir, prompts, 10)
    assert_engine_clean(prefill)


def test_sequence_outgrowing_the_whole_pool_ends_with_length_instead_of_spinning(checkpoint, make_llm):
    # 4 blocks of 4 tokens: a 10-token prompt can grow to 16 tokens, then no preemption can make room.
    llm = make_llm(checkpoint(TinySpec()), block_size=4, num_kv_blocks=4, enable_prefix_caching=False)
    out = llm.generate([list(range(10, 20))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and 1 <= len(out.token_ids) <= 16 - 10 + 1
