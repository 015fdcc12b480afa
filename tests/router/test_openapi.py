"""The HTTP front's OpenAPI document against the parser it describes, without a cluster.

The document is valid OpenAPI 3.1 with JSON Schema 2020-12 schemas; every body field the parser reads is
documented, and every documented one is read (`user` only to check its type); and over cases schemathesis
generates from the document, a body the document accepts parses (or is refused for a rule the document
lists, naming that field) and a body it rejects is refused. tests/router/test_http_fuzz.py holds the
same over HTTP against a real cluster.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.definitions import OPENAPI_31

from engine.errors import InvalidRequestError
from engine.tokenizer import load_tokenizer
from router.openai.chat_template import ROLES
from router.openai.errors import ALL_ERRORS
from router.openai import openapi
from router.openai.front import waited_s_from
from router.openai.openapi import SERVER_RULES_KEY, decimal_below, openapi_document
from router.openai.parse import MAX_BODY_BYTES, Context, ModelNotFound, decode_body, parse_chat, parse_completion
from router.openai.responses_parse import parse_responses
from router.validation import ModelLimits
from tests.factories import TinySpec

LIMITS = ModelLimits(vocab_size=512, max_model_len=512, has_tokenizer=True)
BODY_LIMIT_BYTES = MAX_BODY_BYTES
PARSERS = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat, "/v1/responses": parse_responses}
EXAMPLES = 40  # per operation and mode; the HTTP fuzz test and benchmarks/http_fuzz.py go further


@pytest.fixture(scope="module")
def context(checkpoint):
    return Context(LIMITS, load_tokenizer(checkpoint(TinySpec())), ("tiny", "/models/tiny"))


@pytest.fixture(scope="module")
def document(context):
    return openapi_document(context, auth=False, max_body_bytes=BODY_LIMIT_BYTES)


def _schemas(node):
    """Every Schema Object of an OpenAPI document (components, parameters, bodies, responses, headers)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "schema" or (key == "schemas" and isinstance(value, dict)):
                yield from ([value] if key == "schema" else value.values())
            else:
                yield from _schemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from _schemas(item)


def test_the_document_is_valid_openapi_3_1(document):
    jsonschema.Draft202012Validator(OPENAPI_31).validate(document)  # the OpenAPI 3.1 schema schemathesis ships
    schemas = list(_schemas(document))
    assert len(schemas) > 10
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
    loaded = schemathesis.openapi.from_dict(document)
    loaded.validate()
    labels = sorted(result.ok().label for result in loaded.get_all_operations())
    assert labels == ["GET /health", "GET /metrics", "GET /openapi.json", "GET /v1/models", "GET /version",
                      "POST /detokenize", "POST /tokenize", "POST /v1/chat/completions", "POST /v1/completions",
                      "POST /v1/responses"]
    assert json.loads(json.dumps(document)) == document  # what the front serves, byte for byte


def test_the_document_states_the_models_limits_and_the_error_table(context, document):
    completion = document["paths"]["/v1/completions"]["post"]
    body = completion["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert body["max_tokens"]["maximum"] == LIMITS.max_model_len - 1
    assert body["stop_token_ids"]["items"]["maximum"] == LIMITS.vocab_size - 1
    assert body["model"]["enum"] == ["tiny", "/models/tiny", None]
    chat = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["messages"]["items"]["properties"]["role"] == {"enum": list(ROLES)}
    statuses = {str(status) for status, _, _ in ALL_ERRORS} - {"401"}
    assert set(completion["responses"]) == {"200"} | statuses
    assert "security" not in document["components"] and completion["security"] == []
    bare = Context(ModelLimits(vocab_size=300, max_model_len=128, has_tokenizer=False), None, ("ids-only",))
    guarded = openapi_document(bare, auth=True, max_body_bytes=BODY_LIMIT_BYTES)
    post = guarded["paths"]["/v1/completions"]["post"]
    prompt = post["requestBody"]["content"]["application/json"]["schema"]["properties"]["prompt"]
    assert all(form.get("type") != "string" for form in prompt["anyOf"])  # no tokenizer: token ids only
    assert post["security"] == [{"bearer": []}] and "401" in post["responses"]
    assert guarded["paths"]["/openapi.json"]["get"]["security"] == [{"bearer": []}]
    assert guarded["paths"]["/health"]["get"]["security"] == []


@pytest.mark.parametrize("bound", [1, 2, 9, 10, 11, 100, 512, 1000, 32000, 151936])
def test_token_id_keys_match_exactly_the_vocabulary(bound):
    pattern = re.compile(f"^0*({decimal_below(bound)})$")
    assert [k for k in range(bound + 1200) if pattern.match(str(k))] == list(range(bound))
    assert pattern.match(f"00{bound - 1}") and not pattern.match("") and not pattern.match("-1")


class _Reads(dict):
    """A body that records which of its keys the parser looks at."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("path, bodies", [
    ("/v1/completions", [{"prompt": [1, 2]}, {"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 0}]),
    ("/v1/chat/completions", [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "max_tokens": 4,
         "logprobs": True, "top_logprobs": 2},
    ]),
])
def test_the_parser_reads_exactly_the_documented_fields(context, document, path, bodies):
    read: set[str] = set()
    for body in bodies:
        recorded = _Reads(body)
        PARSERS[path](recorded, context)
        read |= recorded.read
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert read <= set(schema["properties"]), read - set(schema["properties"])
    assert set(schema["properties"]) == read
    assert set(document["paths"][path]["post"][SERVER_RULES_KEY]) <= read


def _outcome(path: str, case, context) -> str | None:
    """None when the parser (and the front's header check) accepts the case, else the field it names."""
    try:
        body = decode_body(json.dumps(case.body).encode())  # as it comes over the wire
    except TypeError:  # not JSON at all; the HTTP test sends such bodies
        return "unsendable"
    headers = dict(case.headers or {})
    try:
        PARSERS[path](body, context, headers.get("X-Request-Id"))
        waited_s_from(headers)
    except InvalidRequestError as err:
        return err.field
    except ModelNotFound:
        return "model"
    return None


def _head(field: str) -> str:
    return re.split(r"[.\[]", field, maxsplit=1)[0]


@pytest.mark.parametrize("path", sorted(PARSERS))
def test_a_body_the_document_accepts_is_parsed_or_refused_for_a_listed_rule(context, document, path):
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    rules = document["paths"][path]["post"][SERVER_RULES_KEY]
    parsed = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def check(case):
        field = _outcome(path, case, context)
        assert field is None or _head(field) in rules, (field, case.body, case.headers)
        parsed.append(field is None)

    check()
    assert sum(parsed) > EXAMPLES // 2, "most valid bodies should parse"


@pytest.mark.parametrize("path", sorted(PARSERS))
def test_a_body_the_document_rejects_is_refused(context, document, path):
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    refused = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def check(case):
        field = _outcome(path, case, context)
        assert field is not None, (case.body, case.headers)
        refused.append(field)

    check()
    # About a third of the negative cases are raw bytes, not JSON (refused by the front before any parser).
    assert len([f for f in refused if f != "unsendable"]) > EXAMPLES // 3


def test_a_sampling_key_the_parser_reads_must_be_documented(context, monkeypatch):
    monkeypatch.setattr(openapi, "_SAMPLING_KEYS", (*openapi._SAMPLING_KEYS, "undocumented_knob"))
    with pytest.raises(RuntimeError, match="undocumented_knob"):  # the router then does not start
        openapi.openapi_document(context, auth=False, max_body_bytes=BODY_LIMIT_BYTES)
