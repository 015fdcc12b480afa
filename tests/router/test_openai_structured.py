"""Structured outputs through the router (1 prefill + 1 decode: the first token is sampled under the
grammar on the prefill worker, the decode instance replays it and continues): the real `openai` client,
sync and async, streamed and whole, `response_format` and vLLM's `structured_outputs` on both endpoints,
`chat.completions.parse` with a pydantic model, the gRPC SDK's fields, and a spec that cannot compile
refused naming its field on both fronts."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from engine.tokenizer import load_tokenizer
from splitserve_client.client import Client
from splitserve_client.sdk_types import InvalidArgument
from tests.engine.test_structured_outputs import SCHEMA
from tests.factories import TinySpec

SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 120}


@pytest.fixture(scope="module")
def http_url(router_stack) -> str:
    return router_stack.server.http.url


@pytest.fixture(scope="module")
def client(http_url):
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


def test_chat_json_schema_at_temperature_1_always_validates(client, model, router_stack):
    messages = [{"role": "user", "content": "Describe a pet."}]
    reply = client.chat.completions.create(
        model=model, messages=messages, n=3, response_format=_json_schema_format(SCHEMA), **SAMPLED
    )
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    free = client.chat.completions.create(model=model, messages=messages, n=3, **{**SAMPLED, "max_tokens": 40})
    for choice in free.choices:  # the same model without the grammar: never a valid document
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    router_stack.check_workers_clean()


class Owner(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    id: int = pydantic.Field(ge=0, le=99)
    vip: bool


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    kind: Literal["cat", "dog", "owl"]
    owner: Owner
    tags: list[Literal["a", "b", "c"]] = pydantic.Field(max_length=3)


def test_parse_with_a_pydantic_model(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A pet, please."}], response_format=Pet, **SAMPLED
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "owl")


@pytest.fixture(scope="module")
def closing_tokens(checkpoint) -> list[int]:
    """The ids of `"` and `}`: any JSON object has unbounded strings, so these are favoured to end them."""
    return load_tokenizer(checkpoint(TinySpec())).convert_tokens_to_ids(['"', "}"])


def test_completions_stream_regex_choice_grammar_and_json_object(client, model, closing_tokens):
    cases = [
        ({"regex": r"[a-c]{2,4}-[0-9]{3}"}, lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda text: text in ("yes", "no", "maybe so")),
        ({"grammar": 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'}, lambda text: re.fullmatch(r"\(\d+(,\d+)*\)", text)),
        ({"json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ]
    for structured, matches in cases:
        stream = client.completions.create(
            model=model, prompt="Output:", stream=True, n=2, extra_body={"structured_outputs": structured}, **SAMPLED
        )
        texts = ["", ""]
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert all(matches(text) for text in texts), (structured, texts)
    whole = client.completions.create(
        model=model,
        prompt="{",
        logit_bias={str(t): 8 for t in closing_tokens},
        extra_body={"response_format": {"type": "json_object"}},
        **{**SAMPLED, "max_tokens": 200},
    )
    assert isinstance(json.loads(whole.choices[0].text), dict)


def test_async_chat_streamed_json_schema(http_url, model):
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:

            async def one(seed: int) -> str:
                stream = await sdk.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Pet number {seed}."}],
                    stream=True,
                    response_format=_json_schema_format(SCHEMA),
                    **{**SAMPLED, "seed": seed},
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            return await asyncio.gather(*(one(seed) for seed in range(3)))

    for text in asyncio.run(run()):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": _json_schema_format({"$ref": "#/$defs/nowhere"})}, "response_format.json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(?<=a)b"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}}, "structured_outputs.grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_spec_that_cannot_compile_is_a_400_naming_the_field(client, model, extra, param, stream, router_stack):
    with pytest.raises(openai.BadRequestError) as error:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=stream, **extra
        )
        if stream:
            list(reply)
    assert error.value.body["param"] == param, error.value.body
    router_stack.check_workers_clean()


def test_grpc_structured_output_fields(router_stack):
    with Client(router_stack.target) as sdk:
        done = sdk.generate("Output:", json_schema=SCHEMA, **SAMPLED)
        jsonschema.validate(json.loads(done.text), SCHEMA)
        picked = sdk.generate("Output:", choice=["left", "right"], **SAMPLED)
        assert picked.text in ("left", "right")
        with pytest.raises(InvalidArgument) as error:
            sdk.generate("Output:", regex="(?<=a)b", max_tokens=4)
        assert error.value.field == "sampling.regex"
        with pytest.raises(InvalidArgument) as error:
            sdk.generate("Output:", json_schema="{not json", max_tokens=4)
        assert error.value.field == "sampling.json_schema"
