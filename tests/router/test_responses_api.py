"""The Responses API (`POST /v1/responses`): its translation to chat and its events without a cluster, then the
real `openai` client (`responses.create`, `responses.stream`, `stream=True`, sync and async) over real clusters:
greedy text equal to chat's and to HF's tokens, structured outputs, forced and parsed function calls, reasoning
items, input items reaching the template, errors naming the field, and a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine.demo_model import CHAT_TEMPLATE
from engine.errors import InvalidRequestError
from engine.tokenizer import load_tokenizer
from router.openai import HttpFront
from router.openai.errors import http_error
from router.openai.parse import Context
from router.openai.responses import ResponsesRenderer
from router.openai import responses_parse
from router.openai.openapi import openapi_document
from router.openai.responses_parse import parse_responses
from router.openai.tool_stream import ChatOutput
from router.service_types import Overloaded, RouterOutput
from router.stream_state import Usage
from router.validation import ModelLimits
from tests.factories import TinySpec, hf_greedy_generate
from tests.router.conftest import router_config, start_router
from tests.scripted_checkpoint import make_scripted_checkpoint, scripted_tokenizer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
                   "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_PARAMETERS}
TIME = {"type": "function", "name": "get_time", "parameters": TIME_PARAMETERS}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
# Renders what reaches the template: each message's role, content, calls and call id.
PROBE_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }})"
    "{% endfor %}{% endfor %}{% if reasoning_effort %}[{{ reasoning_effort }}]{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
HISTORY = [
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
    {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
    {"type": "function_call_output", "call_id": "call_7", "output": "rain, 4 degrees"},
]
HISTORY_AS_CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "rain, 4 degrees"},
]
STREAM_EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)
HISTORY_RENDERED = ("<system>Be brief.<user>Weather in Oslo?<assistant>(call call_7 get_weather city=Oslo)"
                    "<tool id=call_7>rain, 4 degrees<assistant>")


@pytest.fixture(scope="module")
def context(checkpoint):
    tokenizer = load_tokenizer(checkpoint(TinySpec()))
    return Context(ModelLimits(512, 512, True), tokenizer, ("tiny",), "hermes", None, None, True)


# ---- without a cluster: the translation ----


def test_input_items_and_instructions_reach_the_template_as_chat_messages(context):
    api = parse_responses({"model": "tiny", "instructions": "Be brief.", "input": HISTORY,
                           "chat_template": PROBE_TEMPLATE}, context)
    [choice] = api.choices
    assert choice.request.prompt_text == HISTORY_RENDERED
    assert choice.request.prompt_token_ids == tuple(context.tokenizer.encode(HISTORY_RENDERED,
                                                                             add_special_tokens=False))
    tooled = parse_responses({"input": "Hi", "tools": [WEATHER], "tool_choice": "none", "reasoning": {"effort": "low"},
                              "chat_template": PROBE_TEMPLATE}, context)
    assert tooled.choices[0].request.prompt_text == "[tool get_weather]<user>Hi[low]<assistant>"
    assert api.kind == "response" and api.echo.instructions == "Be brief."


def test_forced_tools_and_text_formats_become_structured_outputs(context):
    named = parse_responses({"input": "Hi", "tools": [WEATHER, TIME],
                             "tool_choice": {"type": "function", "name": "get_time"}}, context)
    spec = named.choices[0].request.params.structured_output
    assert spec is not None and json.loads(spec.value) == TIME_PARAMETERS
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = parse_responses({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n",
                                                                 "schema": schema}}}, context)
    assert json.loads(shaped.choices[0].request.params.structured_output.value) == schema
    assert parse_responses({"input": "Hi", "text": {"format": {"type": "text"}}}, context).choices[0].request.params \
        .structured_output is None
    capped = parse_responses({"input": "Hi", "max_output_tokens": 7, "temperature": 0}, context)
    assert capped.choices[0].request.params.max_tokens == 7


@pytest.mark.parametrize("body, field", [
    ({"input": "Hi", "store": True}, "store"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "Hi", "n": 2}, "n"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": "{}"}}},
     "text.format.schema"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input[0].colour"),
    ({"input": []}, "input"),
    ({"input": "Hi", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "Hi", "reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
])
def test_errors_name_the_field_as_the_responses_body_calls_it(context, body, field):
    with pytest.raises(InvalidRequestError) as raised:
        parse_responses(body, context)
    assert raised.value.field == field
    error = json.loads(http_error(raised.value, "input").body)["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")


# ---- without a cluster: events and the whole response from the same steps ----


def _outputs(pieces: list[str], finish_reason: str) -> list[RouterOutput]:
    last = len(pieces) - 1
    return [RouterOutput("r-0", (i + 1,), text, (), finish_reason if i == last else None,
                         usage=Usage(3, len(pieces), 2) if i == last else None) for i, text in enumerate(pieces)]


def _sdk_events(data: bytes) -> list[dict]:
    """The stream's events, each validated against the openai client's own types."""
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            STREAM_EVENT.validate_python(event)
            events.append(event)
    return events


@pytest.mark.parametrize("parsed", [False, True])
def test_streamed_events_reassemble_to_the_whole_response(context, parsed):
    body = {"input": "Hi", "tools": [WEATHER], "max_output_tokens": 40}
    api = parse_responses(body if parsed else {"input": "Hi"}, context)
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "unit": "f"}}</tool_call>'
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    whole, streamed = ResponsesRenderer(api, None, 0), ResponsesRenderer(api, None, 0)
    outputs = _outputs(pieces, "stop")
    for output in outputs:
        whole.add(0, output)
    events = _sdk_events(b"".join(streamed.chunk(0, output) for output in outputs) + streamed.closing())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    response = json.loads(whole.response())
    Response.model_validate(response)
    assert _without_ids(final) == _without_ids(response)
    assert response["usage"] == {"input_tokens": len(api.choices[0].request.prompt_token_ids),
                                 "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
                                 "output_tokens": len(pieces), "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": len(api.choices[0].request.prompt_token_ids) + len(pieces)}
    # Reassembled by hand from the deltas, as a client without the SDK's helper does.
    texts: dict[int, str] = {}
    for event in events:
        if event["type"] in ("response.output_text.delta", "response.function_call_arguments.delta"):
            texts[event["output_index"]] = texts.get(event["output_index"], "") + event["delta"]
    items = response["output"]
    if not parsed:
        assert [item["type"] for item in items] == ["message"] and texts == {0: text}
        assert items[0]["content"][0]["text"] == text
        return
    assert [item["type"] for item in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == texts[0] == "Checking."
    call = items[1]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Lima", "unit": "f"})
    assert texts[1] == call["arguments"] and call["call_id"].startswith("call_")


def test_a_response_cut_by_max_output_tokens_is_incomplete_and_reasoning_is_an_item(context):
    reasoning = Context(context.limits, context.tokenizer, ("tiny",), None, "deepseek_r1")
    api = parse_responses({"input": "Why?", "max_output_tokens": 4}, reasoning)
    renderer = ResponsesRenderer(api, None, 0)
    data = b"".join(renderer.chunk(0, o) for o in _outputs(["plan", "</think>", "It is", " so"], "length"))
    final = _sdk_events(data)[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    reasoning_item, message = final["output"]
    assert reasoning_item["type"] == "reasoning" and reasoning_item["content"][0]["text"] == "plan"
    assert message["content"][0]["text"] == "It is so" and message["status"] == "incomplete"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # "plan" and the closing tag
    assert ChatOutput(api.output).message("plan</think>It is so")["content"] == "It is so"


def test_a_failure_after_the_200_is_an_error_event_then_response_failed(context):
    renderer = ResponsesRenderer(parse_responses({"input": "Hi"}, context), None, 0)
    opening = renderer.chunk(0, RouterOutput("r-0", (5,), "Hel", (), None))
    error = http_error(Overloaded("the decode pool is full", 1.0), "input")
    events = _sdk_events(opening + renderer.failure(error))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == json.loads(error.body)["error"]["code"] == "overloaded"
    assert events[-1]["response"]["error"]["code"] == "rate_limit_exceeded"  # the same, in OpenAI's set
    assert events[-1]["response"]["status"] == "failed"


def _without_ids(response: dict) -> dict:
    return {**response, "output": [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                                   for item in response["output"]]}


# ---- the real client over a cluster ----


@pytest.fixture(scope="module")
def front(router_stack):
    """A second HTTP front on the shared stack's router that runs a request's own template."""
    service = router_stack.server.service
    http = router_stack.loop.call(HttpFront.start(service, host="127.0.0.1", port=0, model_names=("tiny",),
                                                  trust_request_chat_template=True))
    yield http
    router_stack.loop.call(http.stop(grace_s=1.0))


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def _async_client(front) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)


GREEDY = dict(temperature=0.0, max_output_tokens=12, extra_body={"ignore_eos": True})


def test_greedy_text_equals_chat_and_hf_whole_streamed_sync_and_async(client, front, checkpoint, router_stack):
    tokenizer = load_tokenizer(checkpoint(TinySpec()))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    expected = tokenizer.decode(hf_greedy_generate(checkpoint(TinySpec()), [prompt], 12)[0], skip_special_tokens=True)
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_completion_tokens=12,
                                          extra_body={"ignore_eos": True})
    whole = client.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.", **GREEDY)
    assert whole.output_text == chat.choices[0].message.content == expected
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == "tiny"
    assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens) == (
        len(prompt), 12, len(prompt) + 12)
    with client.responses.stream(model="tiny", instructions="Be brief.", input="Name a colour.", **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.output_text == expected and final.usage == whole.usage and final.status == "incomplete"

    async def run():
        async with _async_client(front) as sdk:
            stream = await sdk.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.",
                                                stream=True, **GREEDY)
            events = [event async for event in stream]
            again = await sdk.responses.create(model="tiny", instructions="Be brief.", input="Name a colour.", **GREEDY)
            return events, again

    events, again = asyncio.run(asyncio.wait_for(run(), 120))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert again.output_text == expected
    completed = events[-1].response  # the whole response, as the stream's last event carries it
    assert events[-1].type == "response.completed" and completed.output_text == expected
    assert _without_ids(completed.model_dump(exclude={"id", "created_at"})) == _without_ids(
        whole.model_dump(exclude={"id", "created_at"}))
    router_stack.check_workers_clean()


def test_function_call_output_items_reach_the_template_and_answer_as_chat_does(client, checkpoint):
    body = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True, "chat_template": PROBE_TEMPLATE})
    reply = client.responses.create(instructions="Be brief.", input=HISTORY, max_output_tokens=8, **body)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}, *HISTORY_AS_CHAT],
                                          max_tokens=8, **body)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    tokenizer = load_tokenizer(checkpoint(TinySpec()))
    assert chat.usage.prompt_tokens == len(tokenizer.encode(HISTORY_RENDERED, add_special_tokens=False))


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "shade": {"type": "integer"}},
              "required": ["colour", "shade"], "additionalProperties": False}
    for seed in (1, 2):
        reply = client.responses.create(model="tiny", input="A colour as JSON.", temperature=1.0, max_output_tokens=60,
                                        text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                                                         "strict": True}}, extra_body={"seed": seed})
        assert reply.status == "completed", reply
        jsonschema.validate(json.loads(reply.output_text), schema)
        assert reply.text.format.type == "json_schema"


def test_forced_function_calls_validate_against_their_schemas_whole_and_streamed(client, front):
    reply = client.responses.create(model="tiny", input="Weather?", tools=[WEATHER, TIME], tool_choice="required",
                                    temperature=1.0, max_output_tokens=200, extra_body={"seed": 3})
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and reply.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id.startswith("call_")
    named = {"type": "function", "name": "get_weather"}

    async def run():
        async with _async_client(front) as sdk:
            stream = await sdk.responses.create(model="tiny", input="Weather?", tools=[WEATHER, TIME],
                                                tool_choice=named, temperature=1.0, max_output_tokens=200,
                                                stream=True, extra_body={"seed": 4})
            return [event async for event in stream]

    events = asyncio.run(asyncio.wait_for(run(), 120))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert events[-1].type == "response.completed" and call.name == "get_weather"
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_bad_requests_name_the_field_and_disturb_no_other_request(client, front, router_stack):
    bad = {"store": True, "previous_response_id": "resp_x", "background": True,
           "tools": [{"type": "web_search_preview"}], "max_output_tokens": 0}
    for name, value in bad.items():
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.create(model="tiny", input="Hi", **{name: value})
        param = raised.value.body["param"]
        assert param == ("tools[0].type" if name == "tools" else name), raised.value.body
        assert raised.value.body["message"].startswith(f"{param}: ")
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", input="Hi", extra_body={"frobnicate": True})
    assert raised.value.body["param"] == "frobnicate"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="Hi")

    async def run():
        async with _async_client(front) as sdk:
            good = sdk.responses.create(model="tiny", input="Name a colour.", **GREEDY)
            refused = [sdk.responses.create(model="tiny", input="Hi", store=True) for _ in range(3)]
            return await asyncio.gather(good, *refused, return_exceptions=True)

    good, *refused = asyncio.run(asyncio.wait_for(run(), 120))
    assert all(isinstance(r, openai.BadRequestError) for r in refused)
    plain = client.responses.create(model="tiny", input="Name a colour.", **GREEDY)
    assert good.output_text == plain.output_text and good.usage.output_tokens == 12
    router_stack.check_workers_clean()


def test_client_disconnect_mid_stream_cancels_the_request(front, router_stack):
    body = json.dumps({"model": "tiny", "input": "Tell a long story.", "max_output_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{front.url}/v1/responses", body, {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=30)
    assert response.readline() == b"event: response.created\n"
    response.close()  # the server sees the connection drop and cancels the request
    deadline_s = time.monotonic() + 30
    while router_stack.server.service.inflight_requests:
        assert time.monotonic() < deadline_s, "the request still runs after its client left"
        time.sleep(0.05)
    router_stack.check_workers_clean()


# ---- parsed calls and reasoning: a model trained to write them ----

THINK_TEMPLATE = CHAT_TEMPLATE.replace("<|turn|>assistant\n{% endif %}",
                                       "<|turn|>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WHY = [{"role": "user", "content": "Why?"}]
TOOL_ANSWER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THINK_ANSWER = ("Because it is.", "It is so.")


@pytest.fixture(scope="module")
def scripted(ray_session, tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted-responses", numbered=False)
    tokenizer = scripted_tokenizer()
    ask = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    why = tokenizer.apply_chat_template(WHY, tokenize=False, add_generation_prompt=True, chat_template=THINK_TEMPLATE,
                                        enable_thinking=True)
    make_scripted_checkpoint(folder, [(ask, TOOL_ANSWER), (why, "</think>".join(THINK_ANSWER))])
    stack = start_router(folder, router_config(tool_call_parser="hermes", trust_request_chat_template=True))
    thinking = stack.loop.call(HttpFront.start(stack.server.service, host="127.0.0.1", port=0,
                                               model_names=(folder.name,), reasoning_parser="deepseek_r1",
                                               trust_request_chat_template=True))
    yield stack, thinking, folder.name  # the served model's name
    stack.loop.call(thinking.stop(grace_s=1.0))
    stack.stop()


def test_parsed_function_calls_and_reasoning_items_whole_and_streamed(scripted):
    stack, thinking, model = scripted
    with openai.OpenAI(base_url=f"{stack.server.http.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        whole = sdk.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], temperature=0)
        with sdk.responses.stream(model=model, input="Weather in Paris?", tools=[WEATHER], temperature=0) as s:
            streamed = s.get_final_response()
    for reply in (whole, streamed):
        [call] = reply.output
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
        assert reply.output_text == "" and reply.status == "completed"
    body = dict(model=model, input="Why?", temperature=0, reasoning={"effort": "low"},
                extra_body={"chat_template": THINK_TEMPLATE, "chat_template_kwargs": {"enable_thinking": True}})
    with openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        whole = sdk.responses.create(**body)
        with sdk.responses.stream(**body) as stream:
            reasoning_deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
            streamed = stream.get_final_response()
    for reply in (whole, streamed):
        reasoning, message = reply.output
        assert (reasoning.type, reasoning.content[0].text) == ("reasoning", THINK_ANSWER[0])
        assert reply.output_text == THINK_ANSWER[1]
        assert 0 < reply.usage.output_tokens_details.reasoning_tokens < reply.usage.output_tokens
    assert reasoning_deltas == THINK_ANSWER[0]


def test_the_openapi_document_lists_exactly_the_fields_the_parser_knows(context):
    document = openapi_document(context, auth=False, max_body_bytes=1024)
    operation = document["paths"]["/v1/responses"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == set(responses_parse.FIELD_HANDLERS) and body["additionalProperties"] is False
    assert set(operation["x-splitserve-server-rules"]) <= set(body["properties"])
    events = document["components"]["schemas"]["ResponseStreamEvent"]["anyOf"]
    kinds = {event["properties"]["type"]["const"] for event in events}
    members = {member.model_fields["type"].annotation.__args__[0] for member in ResponseStreamEvent.__origin__.__args__}
    assert kinds <= members  # every event type written is one the openai client knows
