"""OpenAI bodies → domain requests, and exceptions → HTTP statuses, without a cluster."""
from __future__ import annotations

import copy
import json

import pytest

from cluster.client import RequestFailed
from engine.errors import InvalidRequestError
from engine.tokenizer import load_tokenizer
from router.errors import Unauthenticated
from router.openai.chat_template import ROLES
from router.openai.errors import http_error
from router.openai.parse import (
    MAX_JSON_DEPTH,
    BodyTooLarge,
    Context,
    ModelNotFound,
    decode_body,
    parse_chat,
    parse_completion,
)
from policies.routing import NoWorkersError
from router.service import DuplicateRequest, Overloaded
from router.validation import ModelLimits
from tests.factories import TinySpec

LIMITS = ModelLimits(vocab_size=512, max_model_len=512, has_tokenizer=True)


@pytest.fixture(scope="module")
def context(checkpoint):
    return Context(LIMITS, load_tokenizer(checkpoint(TinySpec())), ("tiny", "/models/tiny"))


def test_a_completion_fans_out_prompts_times_n_with_seed_plus_i(context):
    api = parse_completion({"model": "/models/tiny", "prompt": ["Hello", [5, 6]], "n": 2, "seed": 9,
                            "max_tokens": 4, "priority": 3, "tenant": "acme", "ttft_ms": 250}, context, "abc")
    assert api.model == "tiny" and api.request_id == "abc"
    assert [(c.index, c.prompt_index) for c in api.choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [c.request.request_id for c in api.choices] == ["abc-0", "abc-1", "abc-2", "abc-3"]
    assert [c.request.params.seed for c in api.choices] == [9, 10, 9, 10]
    assert all(c.request.params.n == 1 and c.request.params.max_tokens == 4 for c in api.choices)
    assert api.choices[2].request.prompt_token_ids == (5, 6)
    assert api.choices[0].request.prompt_token_ids == tuple(context.tokenize("Hello"))
    first = api.choices[0].request
    # priority is vLLM's on the OpenAI front (lower first): the router's (higher first) is its negation.
    assert (first.priority, first.tenant, first.ttft_ms, first.tpot_ms) == (-3, "acme", 250.0, None)


def test_defaults_and_vllm_extras(context):
    api = parse_completion({"prompt": [1, 2], "top_k": -1, "min_p": 0.1, "repetition_penalty": 1.2,
                            "stop_token_ids": [7], "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}, context)
    params = api.choices[0].request.params
    assert params.max_tokens == 16 and params.top_k is None and params.min_p == 0.1
    assert params.stop_token_ids == (7,) and params.ignore_eos and params.repetition_penalty == 1.2
    assert api.stream and api.include_usage and api.model == "tiny"
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                       "logprobs": True, "top_logprobs": 2}, context)
    request = chat.choices[0].request
    assert request.params.max_tokens == 512 - len(request.prompt_token_ids)  # chat: up to the context
    assert request.params.logprobs == 2 and chat.logprobs == 2


def test_echo_with_logprobs_asks_for_the_prompts_logprobs(context):
    echoed = parse_completion({"prompt": [5, 6, 7], "echo": True, "logprobs": 2, "max_tokens": 1}, context)
    assert echoed.choices[0].request.params.prompt_logprobs == 2 and echoed.choices[0].echo is not None
    plain = parse_completion({"prompt": [5, 6, 7], "logprobs": 2}, context)
    assert plain.choices[0].request.params.prompt_logprobs is None
    scored = parse_completion({"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 0}, context)
    assert scored.choices[0].echo_only and scored.choices[0].request.params.max_tokens == 1
    with pytest.raises(InvalidRequestError) as err:  # max_tokens 0 only scores an echoed prompt
        parse_completion({"prompt": [5, 6, 7], "max_tokens": 0}, context)
    assert err.value.field == "max_tokens"


def test_logit_bias_keys_are_token_ids_written_as_strings(context):
    api = parse_completion({"prompt": [1], "n": 2, "logit_bias": {"300": 2.5, "7": -100}}, context)
    assert [c.request.params.logit_bias for c in api.choices] == [((7, -100.0), (300, 2.5))] * 2
    with pytest.raises(InvalidRequestError, match="twice"):
        parse_completion({"prompt": [1], "logit_bias": {"7": 1, "07": 2}}, context)
    assert parse_completion({"prompt": [1], "logit_bias": {}}, context).choices[0].request.params.logit_bias == ()


@pytest.mark.parametrize("body, field", [
    ({}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [1], "stream": "yes"}, "stream"), ({"prompt": [1], "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": [1], "stop": 5}, "stop"), ({"prompt": [1], "stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"prompt": [1], "echo": True, "logprobs": 21}, "logprobs"), ({"prompt": [1], "best_of": 3}, "best_of"),
    ({"prompt": [1], "suffix": "x"}, "suffix"), ({"prompt": [1], "n": 300}, "n"),
    ({"prompt": [[1]] * 200, "n": 2}, "n"), ({"prompt": [1], "timeout_ms": 0}, "timeout_ms"),
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": [1], "tenant": "t" * 200}, "tenant"), ({"prompt": [1], "model": 5}, "model"),
    ({"prompt": [1], "logit_bias": {"x": 1}}, "logit_bias"), ({"prompt": [1], "logit_bias": {"512": 1}}, "logit_bias"),
    ({"prompt": [1], "logit_bias": {"-3": 1}}, "logit_bias"), ({"prompt": [1], "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"prompt": [1], "logit_bias": {"5": 100.5}}, "logit_bias"), ({"prompt": [1], "logit_bias": [5, 1]}, "logit_bias"),
])
def test_bad_completion_fields_are_named(context, body, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion(body, context)
    assert err.value.field == field


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"), ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
])
def test_bad_chat_fields_are_named(context, body, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_chat(body, context)
    assert err.value.field == field


@pytest.mark.parametrize("body, field", [
    ({"prompt": [1], "stream_options": False}, "stream_options"), ({"prompt": [1], "tenant": 0}, "tenant"),
    ({"prompt": [1], "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),  # without stream
    ({"prompt": [1], "best_of": True}, "best_of"), ({"prompt": [1], "top_k": False}, "top_k"),
    ({"prompt": [1], "stop": {"a": 1}}, "stop"), ({"prompt": [1], "stop_token_ids": {}}, "stop_token_ids"),
    ({"prompt": [1], "logit_bias": {"\u0663": 1}}, "logit_bias"),  # an Arabic-Indic 3, which int() reads
    ({"prompt": [1], "suffix": 0}, "suffix"), ({"prompt": [1], "tools": {}}, "tools"),
    ({"prompt": [1], "functions": False}, "functions"), ({"prompt": [1], "tool_choice": "required"}, "tool_choice"),
    ({"prompt": [1], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": [1], "response_format": {"type": ["json_object"]}}, "response_format.type"),  # unhashable
    ({"prompt": [1], "response_format": "text"}, "response_format"),
    ({"prompt": [1], "user": 7}, "user"), ({"prompt": [1], "stop": [["x"]]}, "stop"),
])
def test_json_values_python_would_coerce_are_refused(context, body, field):
    """What the OpenAPI document rejects, the parser rejects: no falsy value stands in for null, no
    object for a list, no boolean for a number."""
    with pytest.raises(InvalidRequestError) as err:
        parse_completion(body, context)
    assert err.value.field == field


def test_an_overridden_max_tokens_is_still_checked(context):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"messages": messages, "max_completion_tokens": 4, "max_tokens": "many"}, context)
    assert err.value.field == "max_tokens"
    api = parse_chat({"messages": messages, "max_completion_tokens": 4, "max_tokens": 9}, context)
    assert api.choices[0].request.params.max_tokens == 4


def test_integral_numbers_are_integers_and_neutral_values_are_accepted(context):
    body = decode_body(b'{"prompt": [1.0, 2], "max_tokens": 4.0, "n": 2e0, "seed": 1e3, "temperature": 0.5,'
                       b' "suffix": "", "tools": [], "functions": null, "tool_choice": "auto",'
                       b' "response_format": {"type": "text"}, "stream_options": null, "tenant": null}')
    api = parse_completion(body, context)
    assert [c.request.params.seed for c in api.choices] == [1000, 1001]
    assert api.choices[0].request.prompt_token_ids == (1, 2) and api.choices[0].request.params.max_tokens == 4
    assert api.choices[0].request.params.temperature == 0.5 and api.choices[0].request.tenant == ""
    assert parse_completion({"prompt": [1], "response_format": {}}, context).choices
    with pytest.raises(InvalidRequestError) as err:
        parse_completion(decode_body(b'{"prompt": [1], "max_tokens": 4.5}'), context)
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        decode_body(b"{not json")
    assert err.value.field == "body"


def test_json_nested_deeper_than_the_limit_is_refused_before_decoding():
    at_the_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json.dumps(decode_body(at_the_limit.encode())) == at_the_limit
    for body in (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), b'{"a": ' * 100_000,
                 b"[" * 100_000 + b"]" * 100_000):  # the last two once escaped as a RecursionError
        with pytest.raises(InvalidRequestError) as err:
            decode_body(body)
        assert err.value.field == "body" and f"deeper than {MAX_JSON_DEPTH} levels" in err.value.reason
    nested = decode_body(b'{"a": ' * (MAX_JSON_DEPTH - 1) + b"[1]" + b"}" * (MAX_JSON_DEPTH - 1))
    assert nested["a"]["a"]
    text = '[{\\"]}' * 1000  # brackets and escaped quotes inside a string do not count
    assert decode_body(json.dumps({"s": text}).encode("utf-16")) == {"s": text}
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        decode_body(b'["unclosed')


def test_chat_roles_are_openais(context):
    for role in ROLES:
        messages = [{"role": role, "content": "Hi"}, {"role": "user", "content": "Hi"}]
        assert parse_chat({"messages": messages, "max_tokens": 1}, context).choices
    with pytest.raises(InvalidRequestError, match="must be one of system, developer, user, assistant, tool"):
        parse_chat({"messages": [{"role": "wizard", "content": "Hi"}]}, context)


def test_chat_without_a_template_is_a_clear_400(context):
    tokenizer = copy.deepcopy(context.tokenizer)
    tokenizer.chat_template = None
    bare = Context(LIMITS, tokenizer, ("tiny",))
    with pytest.raises(InvalidRequestError, match="no chat template") as err:
        parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, bare)
    error = http_error(err.value, "messages")
    assert error.status == 400 and json.loads(error.body)["error"]["param"] == "messages"


def test_unknown_model_comes_first(context):
    with pytest.raises(ModelNotFound):
        parse_completion({"model": "other", "prompt": [1]}, context)
    with pytest.raises(ModelNotFound):  # a 404, not a 400 for the bad prompt
        parse_chat({"model": "other", "messages": []}, context)


@pytest.mark.parametrize("error, status, code, param", [
    (InvalidRequestError("sampling.temperature", "must be >= 0"), 400, "invalid_value", "temperature"),
    (InvalidRequestError("token_ids", "prompt needs 99 KV blocks"), 400, "invalid_value", "messages"),
    (Unauthenticated("no token"), 401, "invalid_api_key", None),
    (ModelNotFound("x", "tiny"), 404, "model_not_found", "model"),
    (BodyTooLarge(1024), 413, "body_too_large", "body"),
    (DuplicateRequest("running"), 409, "request_id_in_use", "request_id"),
    (Overloaded("ttft SLO", 0.25), 429, "overloaded", None),
    (RequestFailed("KV pool full", out_of_capacity=True), 429, "overloaded", None),
    (NoWorkersError("no healthy decode instance"), 503, "unavailable", None),
    (RequestFailed("worker died", unavailable=True), 503, "unavailable", None),
    (RequestFailed("deadline passed", timed_out=True), 504, "deadline_exceeded", None),
    (KeyError("bug"), 500, "internal_error", None),
])
def test_one_mapping_from_exceptions_to_http(error, status, code, param):
    mapped = http_error(error, "messages")
    body = json.loads(mapped.body)["error"]
    assert (mapped.status, body["code"], body["param"]) == (status, code, param)
    assert body["message"] and body["type"]
    if status == 429:
        assert int(mapped.headers["Retry-After"]) >= 1 and "retry-after-ms" in mapped.headers
    if status == 500:
        assert "bug" not in body["message"]  # details go to the log, never to the client
    if param is not None:
        assert body["message"].startswith(f"{param}: ")
