"""The agent-facing chat API with the real `openai` client (sync and async, streamed and whole) over real
clusters: tool calls forced by tool_choice (required, named) on random weights, tool calls and reasoning
parsed from a model trained to write them, template options, vLLM's tokenizer routes, model aliases,
the API key and per-chunk usage."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import jsonschema
import openai
import pytest

from engine.demo_model import CHAT_TEMPLATE
from engine.tokenizer import load_tokenizer
from router.openai import HttpFront
from tests.factories import TinySpec
from tests.router.conftest import router_config, start_router
from tests.scripted_checkpoint import make_scripted_checkpoint, scripted_tokenizer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
                   "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# R1 style: the template opens the thinking when the kwarg asks for it; the model closes it.
THINK_TEMPLATE = CHAT_TEMPLATE.replace("<|turn|>assistant\n{% endif %}",
                                       "<|turn|>assistant\n{% if enable_thinking %}<think>{% endif %}{% endif %}")
WHY = [{"role": "user", "content": "Why?"}]
TOOL_ANSWER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THINK_ANSWER = ("Because it is.", "It is so.")
TOKEN = "sk-splitserve-test"


def _start_front(stack, **options) -> HttpFront:
    service = stack.server.service
    return stack.loop.call(HttpFront.start(service, host="127.0.0.1", port=0, **options))


@pytest.fixture(scope="module")
def front(router_stack):
    """A second HTTP front on the shared stack's router: an API key, two names, per-request templates."""
    http = _start_front(router_stack, token=TOKEN, model_names=("tiny-a", "tiny-b"), tool_call_parser="hermes",
                        trust_request_chat_template=True)
    yield http
    router_stack.loop.call(http.stop(grace_s=1.0))


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key=TOKEN, max_retries=0, timeout=120) as sdk:
        yield sdk


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _reassemble(chunks) -> dict:
    """A stream's deltas put together, as agent frameworks do it."""
    out: dict = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": [], "chunks": 0}
    for chunk in chunks:
        if chunk.usage is not None:
            out["usage"].append(chunk.usage.completion_tokens)
        if not chunk.choices:
            continue
        out["chunks"] += 1
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out


# ---- forced calls on random weights: the grammar holds the output to the declared schema ----


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_parses_into_a_declared_function(client, parallel):
    response = client.chat.completions.create(
        model="tiny-b", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel,
        temperature=1.0, seed=3, n=4, max_tokens=200,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = _calls(choice.message)
        assert calls and (parallel or len(calls) == 1)
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        assert len({c.id for c in choice.message.tool_calls}) == len(calls)
    stream = client.chat.completions.create(
        messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=5, max_tokens=200,
        stream=True, model="tiny-a",
    )
    whole = _reassemble(stream)
    assert whole["finish"] == "tool_calls" and whole["calls"]
    for call in whole["calls"]:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_named_tool_choice_gives_that_functions_arguments_sync_async_and_streamed(client, front):
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model="tiny-a", messages=ASK, tools=[WEATHER, TIME],
                                              tool_choice=named, temperature=1.0, seed=11, n=3, max_tokens=200)
    for choice in response.choices:
        [(name, arguments)] = _calls(choice.message)
        assert name == "get_weather" and choice.finish_reason == "stop"
        jsonschema.validate(arguments, WEATHER_PARAMETERS)

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key=TOKEN, max_retries=0, timeout=120) as sdk:
            stream = await sdk.chat.completions.create(model="tiny-a", messages=ASK, tools=[WEATHER],
                                                       tool_choice=named, temperature=1.0, seed=12,
                                                       max_tokens=200, stream=True)
            return _reassemble([chunk async for chunk in stream])

    streamed = asyncio.run(run())
    [call] = streamed["calls"]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)


def test_tools_with_choice_none_leave_the_greedy_text_as_it_was(client):
    plain = client.chat.completions.create(model="tiny-a", messages=ASK, temperature=0.0, max_tokens=12)
    with_tools = client.chat.completions.create(model="tiny-a", messages=ASK, tools=[WEATHER], tool_choice="none",
                                                temperature=0.0, max_tokens=12)
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    assert with_tools.choices[0].message.tool_calls is None and plain.choices[0].message.tool_calls is None


# ---- the vLLM surface ----


def test_api_key_aliases_version_and_the_tokenizer_routes(front, client, checkpoint):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="wrong", max_retries=0, timeout=30) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    assert [card.id for card in client.models.list().data] == ["tiny-a", "tiny-b"]
    assert json.loads(urllib.request.urlopen(f"{front.url}/version", timeout=10).read())["version"]
    tokenizer = load_tokenizer(checkpoint(TinySpec()))
    tokens = _post(front.url, "/tokenize", {"model": "tiny-b", "prompt": "Hello there"})
    assert tokens["tokens"] == tokenizer.encode("Hello there") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 512
    assert _post(front.url, "/detokenize", {"tokens": tokens["tokens"]}) == {"prompt": "Hello there"}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "rain"},
    ]
    probe = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
             "{{ m.content }}{% for c in m.tool_calls or [] %}({{ c.id }} {{ c.function.arguments.city }})"
             "{% endfor %}{{ m.tool_call_id or '' }};{% endfor %}{{ flavour }}")
    rendered = _post(front.url, "/tokenize", {"messages": history, "tools": [WEATHER], "chat_template": probe,
                                              "chat_template_kwargs": {"flavour": "mint"}})
    expected = "[get_weather]user:Weather in Paris?;assistant:(call_9 Oslo);tool:raincall_9;mint"
    assert rendered["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    stream = client.chat.completions.create(
        model="tiny-a", messages=ASK, temperature=0.0, max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    )
    whole = _reassemble(stream)
    counts = whole["usage"]  # a chunk may carry several tokens (a step's, or a slow reader's backlog)
    assert len(counts) == whole["chunks"] + 1 and counts == sorted(counts) and counts[-1] == 6


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


# ---- parsed calls and reasoning: a model trained to write them ----


@pytest.fixture(scope="module")
def scripted(ray_session, tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted", numbered=False)
    tokenizer = scripted_tokenizer()
    ask = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    why = tokenizer.apply_chat_template(WHY, tokenize=False, add_generation_prompt=True, chat_template=THINK_TEMPLATE,
                                        enable_thinking=True)
    make_scripted_checkpoint(folder, [(ask, TOOL_ANSWER), (why, "</think>".join(THINK_ANSWER))])
    stack = start_router(folder, router_config(tool_call_parser="hermes", trust_request_chat_template=True))
    thinking = _start_front(stack, model_names=("scripted",), reasoning_parser="deepseek_r1",
                            trust_request_chat_template=True)
    yield stack, thinking, load_tokenizer(folder)
    stack.loop.call(thinking.stop(grace_s=1.0))
    stack.stop()


def test_auto_tool_calls_parse_from_the_models_text_whole_streamed_and_async(scripted):
    stack, _, _ = scripted
    url = f"{stack.server.http.url}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as sdk:
        whole = sdk.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER], temperature=0.0)
        streamed = _reassemble(sdk.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER],
                                                           temperature=0.0, stream=True))
        untouched = sdk.chat.completions.create(model="scripted", messages=ASK, temperature=0.0)
    choice = whole.choices[0]
    assert _calls(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == _calls(choice.message)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert untouched.choices[0].message.content == TOOL_ANSWER  # without tools the text is the answer

    async def run():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as sdk:
            return await asyncio.gather(*(
                sdk.chat.completions.create(model="scripted", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                            temperature=0.0) for _ in range(2)))

    for response in asyncio.run(run()):
        assert _calls(response.choices[0].message) == [("get_weather", {"city": "Paris"})]


def test_reasoning_splits_from_content_whole_and_streamed(scripted):
    stack, thinking, tokenizer = scripted
    body = dict(model="scripted", messages=WHY, temperature=0.0,
                extra_body={"chat_template": THINK_TEMPLATE, "chat_template_kwargs": {"enable_thinking": True},
                            "return_token_ids": True})
    with openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        whole = sdk.chat.completions.create(**body)
        streamed = _reassemble(sdk.chat.completions.create(**body, stream=True))
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == THINK_ANSWER
    assert (streamed["reasoning"], streamed["content"]) == THINK_ANSWER
    # The kwarg reached the template: the prompt is the one rendered with it.
    rendered = tokenizer.apply_chat_template(WHY, tokenize=False, add_generation_prompt=True,
                                             chat_template=THINK_TEMPLATE, enable_thinking=True)
    assert whole.choices[0].model_extra["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
