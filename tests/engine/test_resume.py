"""A request resumed after k of its tokens (`add_request(..., output_token_ids=...)`, what a migration
sends) continues exactly like the uninterrupted run: greedy, seeded sampling with penalties, and stop
strings that span the point of resumption; bad resumptions are refused naming the field."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from tests.conftest import assert_engine_clean
from tests.factories import TinySpec, random_prompts


def _run(engine: LLMEngine, request_id: str, prompt, params, outputs=()) -> tuple[list[int], str | None, str]:
    seq = engine.add_request(request_id, prompt, params, output_token_ids=outputs)
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished(request_id)
    return seq.output_token_ids, seq.stop_text, seq.finish_reason.value


@pytest.fixture
def engine(checkpoint):
    engine = LLMEngine(EngineConfig(model_dir=str(checkpoint(TinySpec())), num_kv_blocks=128))
    yield engine
    assert_engine_clean(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2),
    SamplingParams(temperature=0.8, seed=11, max_tokens=24, min_tokens=6, ignore_eos=True),
], ids=["greedy", "seeded-penalties", "seeded-min-tokens"])
def test_a_resumed_request_continues_exactly(engine, params):
    prompt = random_prompts(1, 20, 20, 512, seed=31)[0]
    full, _, reason = _run(engine, "full", prompt, params)
    for k in (1, 5, 17):
        resumed, _, resumed_reason = _run(engine, f"resume-{k}", prompt, params, full[:k])
        assert resumed == full and resumed_reason == reason


def test_a_stop_string_spanning_the_resumption_point_still_stops(engine):
    prompt = random_prompts(1, 12, 12, 512, seed=32)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full, _, _ = _run(engine, "probe", prompt, greedy)
    text = engine.stops.tokenizer.decode(full)
    stop = text[len(engine.stops.tokenizer.decode(full[:9])) - 2:][:4]  # starts just before token 9
    assert stop.strip(), "the tiny tokenizer produced whitespace only here; pick another prompt"
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    whole = _run(engine, "whole", prompt, params)
    assert whole[2] == "stop"
    assert _run(engine, "resumed", prompt, params, whole[0][:8]) == whole


@pytest.mark.parametrize("outputs,message", [
    ([5] * 24, "already reach max_tokens"),
    ([10**6], "outside the vocabulary"),
])
def test_bad_resumptions_are_refused_naming_the_field(engine, outputs, message):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=24), output_token_ids=outputs)
    assert err.value.field == "output_token_ids" and message in str(err.value)
    assert not engine.has_unfinished()
