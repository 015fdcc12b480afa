"""Structured outputs in the engine: the offline LLM (colocated), resumed sequences, ngram speculation,
exactness against HF where the grammar allows HF's greedy token, and matchers freed with sequences."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.structured.backend import bitmask_words
from engine.structured.spec import StructuredOutputSpec
from tests.factories import TinySpec, hf_greedy_generate

# Nested objects, arrays, enums, additionalProperties false; strings and arrays bounded so that a
# random model at temperature 1 completes it well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "owner", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120
PROMPTS = ["The prefill worker", "A decode instance streams", "Blocks move between"]


def _texts(outputs) -> list[str]:
    return [completion.text for output in outputs for completion in output.outputs]


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint(TinySpec())


def _sampled(max_tokens: int = MAX_TOKENS, n: int = 4, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, n=n, **extra)


def test_json_schema_outputs_validate_at_temperature_1(make_llm, model_dir):
    llm = make_llm(model_dir)
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    constrained = llm.generate(PROMPTS, _sampled(structured_output=spec), use_tqdm=False)
    assert all(_valid(text) for text in _texts(constrained)), _texts(constrained)
    assert all(c.finish_reason == "stop" for o in constrained for c in o.outputs)
    free = llm.generate(PROMPTS, _sampled(max_tokens=40), use_tqdm=False)
    assert not any(_valid(text) for text in _texts(free))  # the grammar, not the model, makes them valid
    assert not llm.engine.structured.matchers


def test_json_object_regex_and_choice(make_llm, model_dir):
    llm = make_llm(model_dir)
    # Any JSON object: nothing bounds its strings, so closing quotes and braces are favoured to end them.
    closing = dict.fromkeys(llm.tokenizer.convert_tokens_to_ids(['"', "}"]), 8.0)
    json_object = _sampled(structured_output=StructuredOutputSpec("json_object"), logit_bias=closing)
    objects = llm.generate(PROMPTS, json_object, use_tqdm=False)
    assert all(isinstance(json.loads(text), dict) for text in _texts(objects)), _texts(objects)
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    regex = llm.generate(PROMPTS, _sampled(structured_output=StructuredOutputSpec("regex", pattern)), use_tqdm=False)
    assert all(re.fullmatch(pattern, text) for text in _texts(regex)), _texts(regex)
    choices = ("yes", "no", "maybe so")
    spec = StructuredOutputSpec("choice", choices=choices)
    picked = _texts(llm.generate(PROMPTS, _sampled(structured_output=spec), use_tqdm=False))
    assert set(picked) <= set(choices)
    grammar = StructuredOutputSpec("grammar", 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"')
    tuples = llm.generate(PROMPTS, _sampled(structured_output=grammar), use_tqdm=False)
    assert all(re.fullmatch(r"\(\d+(,\d+)*\)", text) for text in _texts(tuples)), _texts(tuples)


def test_with_ngram_speculation(make_llm, model_dir):
    llm = make_llm(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    outputs = llm.generate(PROMPTS, _sampled(n=2, structured_output=spec), use_tqdm=False)
    assert all(_valid(text) for text in _texts(outputs)), _texts(outputs)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    plain = make_llm(model_dir).generate(PROMPTS, greedy, use_tqdm=False)
    speculated = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in speculated] == [o.outputs[0].token_ids for o in plain]
    assert all(_valid(o.outputs[0].text) for o in speculated)
    assert llm.engine.spec.counters.draft_tokens > 0  # drafts were verified under the mask


def test_greedy_equals_hf_under_the_same_grammar(make_llm, model_dir):
    """Greedy under a grammar equals HF `generate` with the same grammar's allowed tokens as its
    `prefix_allowed_tokens_fn` (HF's own masking, independent of the engine's rows and bitmasks); and
    greedy without one is HF's plain greedy."""
    llm = make_llm(model_dir)
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    backend = llm.engine.structured.backend
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert _valid(llm.tokenizer.decode(tokens, skip_special_tokens=True))

        def allowed(batch_id, input_ids, prompt_len=len(prompt)):  # noqa: B008 - binds this prompt's length
            matcher = backend.compile(spec).matcher()
            for token in input_ids[prompt_len:].tolist():
                assert matcher.accept(token)
            words = torch.zeros(bitmask_words(backend.vocab_size), dtype=torch.int32)
            matcher.fill_bitmask(words)
            bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
            return bits[: backend.vocab_size].nonzero().flatten().tolist()

        [reference] = hf_greedy_generate(model_dir, [prompt], len(tokens), prefix_allowed_tokens_fn=allowed)
        assert list(tokens) == reference
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    unconstrained = llm.generate(prompts, plain, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in unconstrained] == hf_greedy_generate(model_dir, prompts, 12)


def test_a_resumed_sequence_replays_its_output(make_llm, model_dir):
    """A migrated request arrives with the tokens it already emitted: the matcher replays them and the
    output completes the same document; tokens the grammar forbids are refused naming the field."""
    llm = make_llm(model_dir)
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    [whole] = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    tokens = whole.outputs[0].token_ids
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    engine.add_request("resumed", prompt, greedy, output_token_ids=tokens[:5])
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_finished("resumed").output_token_ids == list(tokens)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", prompt, greedy, output_token_ids=[tokens[1], tokens[0]])
    assert error.value.field == "structured_outputs.json"
    assert not engine.structured.matchers and "bad" not in engine.seqs


def test_an_uncompilable_spec_is_refused_naming_its_field(make_llm, model_dir):
    llm = make_llm(model_dir)
    spec = StructuredOutputSpec.json_schema({"$ref": "#/$defs/nowhere"}, field="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(PROMPTS, SamplingParams(structured_output=spec), use_tqdm=False)
    assert error.value.field == "response_format.json_schema.schema"
