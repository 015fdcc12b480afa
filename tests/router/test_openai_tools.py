"""Tool calling, reasoning and template options of the chat front, without a cluster: the parsers (whole
and streamed, every cut of the text), tool_choice → the structured-output spec, what reaches the chat
template, priority's mapping, and the config names matching the registries."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.router_config import REASONING_PARSERS, TOOL_CALL_PARSERS
from engine.errors import InvalidRequestError
from engine.tokenizer import load_tokenizer
from router.openai import reasoning, tools
from router.openai.parse import Context, parse_chat, parse_completion
from router.openai.tool_stream import ChatOutput, OutputParsing
from router.validation import ModelLimits
from tests.factories import TinySpec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# Renders what reaches the template: tools, each message's extras, a kwarg, the generation prompt.
PROBE_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }})"
    "{% endfor %}{% endfor %}{% if shout %}!{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def context(checkpoint):
    tokenizer = load_tokenizer(checkpoint(TinySpec()))
    return Context(ModelLimits(512, 512, True), tokenizer, ("tiny",), "hermes", "deepseek_r1", None, True)


def _stream(parsing: OutputParsing, text: str, cut: int) -> dict:
    """Feeds `text` in pieces of `cut` characters and reassembles the deltas as the openai client does."""
    out = ChatOutput(parsing)
    reasoning_text, content, calls = "", "", {}
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)] or [""]
    for i, piece in enumerate(pieces):
        delta = out.delta(piece, i == len(pieces) - 1)
        reasoning_text += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call.get("function", {}).get("arguments", "")
    return {"reasoning": reasoning_text, "content": content, "calls": [calls[i] for i in sorted(calls)]}


def _whole(parsing: OutputParsing, text: str) -> dict:
    message = ChatOutput(parsing).message(text)
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]
    return {"reasoning": message.get("reasoning_content") or "", "content": message["content"] or "", "calls": calls}


HERMES_TEXT = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool_call>not json</tool_call>'
)


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_hermes_calls_parse_whole_and_streamed_alike(cut):
    parsing = OutputParsing(tools.ToolRequest((WEATHER, TIME), "auto"), tools.HermesParser())
    whole, streamed = _whole(parsing, HERMES_TEXT), _stream(parsing, HERMES_TEXT, cut)
    assert [(c["name"], json.loads(c["arguments"])) for c in whole["calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert whole["content"] == "Let me check. done <tool_call>not json</tool_call>"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (c["name"], c["arguments"]) for c in whole["calls"]
    ]
    assert streamed["content"] == whole["content"]
    assert all(c["id"].startswith("call_") for c in streamed["calls"])


@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_llama3_json_calls_and_plain_text(cut):
    parsing = OutputParsing(tools.ToolRequest((WEATHER, TIME), "auto"), tools.Llama3JsonParser())
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}; {"name": "get_time"}'
    for result in (_whole(parsing, text), _stream(parsing, text, cut)):
        assert [(c["name"], json.loads(c["arguments"])) for c in result["calls"]] == [
            ("get_weather", {"city": "Oslo; Norway"}),
            ("get_time", {}),
        ]
        assert result["content"] == ""
    plain = "It is sunny."
    assert _stream(parsing, plain, cut) == _whole(parsing, plain) == {"reasoning": "", "content": plain, "calls": []}


@pytest.mark.parametrize("cut", [1, 5, 1000])
@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("deepseek_r1", "plan it</think>\n\nAnswer.", ("plan it", "\n\nAnswer.")),
        ("deepseek_r1", "<think>plan it</think>Answer.", ("plan it", "Answer.")),
        ("deepseek_r1", "cut short", ("cut short", "")),
        ("qwen3", "<think>plan it</think>Answer.", ("plan it", "Answer.")),
        ("qwen3", "No thinking. <think> here is text", ("", "No thinking. <think> here is text")),
        ("qwen3", "<think>cut short", ("cut short", "")),
    ],
)
def test_reasoning_split_whole_and_streamed(name, text, expected, cut):
    parsing = OutputParsing(reasoning=reasoning.REASONING_PARSERS[name]())
    for result in (_whole(parsing, text), _stream(parsing, text, cut)):
        assert (result["reasoning"], result["content"]) == expected


def test_reasoning_then_a_tool_call():
    parsing = OutputParsing(
        tools.ToolRequest((WEATHER,), "auto"), tools.HermesParser(), reasoning.DeepSeekR1Parser()
    )
    text = 'need weather</think><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    for result in (_whole(parsing, text), _stream(parsing, text, 3)):
        assert result["reasoning"] == "need weather" and result["content"] == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in result["calls"]] == [("get_weather", {"city": "Rome"})]


def test_named_arguments_stream_as_they_are_generated():
    parsing = OutputParsing(tools.ToolRequest((WEATHER,), "named", "get_weather"))
    text = '{"city": "Lima", "unit": "c"}'
    out = ChatOutput(parsing)
    first = out.delta(text[:5], False)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": text[:5]}
    rest = out.delta(text[5:], True)
    assert rest["tool_calls"] == [{"index": 0, "function": {"arguments": text[5:]}}]
    assert _whole(parsing, text)["calls"][0]["arguments"] == text
    assert out.finish_reason("stop") == "stop"  # as OpenAI ends a forced call


def test_required_output_parses_into_calls_and_ends_with_tool_calls():
    parsing = OutputParsing(tools.ToolRequest((WEATHER, TIME), "required"))
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Kyiv"}}]'
    out = ChatOutput(parsing)
    message = out.message(text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time", "get_weather"]
    assert message["content"] is None and out.finish_reason("stop") == "tool_calls"
    assert out.finish_reason("length") == "length"


def test_tool_choice_becomes_vllms_structured_output_spec():
    required = tools.parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    spec = required.structured_output()
    assert spec.kind == "json" and spec.field == "tool_choice"
    schema = json.loads(spec.value)
    call = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(call, schema)
    for bad in ([], call * 2, [{"name": "get_weather", "parameters": {"town": "Oslo"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tools.parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(named.structured_output().value) == WEATHER["function"]["parameters"]
    assert tools.parse_tools({"tools": [WEATHER], "tool_choice": "auto"}).structured_output() is None
    assert tools.parse_tools({"tools": [], "tool_choice": "none"}) is None


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        tools.parse_tools(body)
    assert err.value.field == field


def test_tools_history_and_kwargs_reach_the_template(context):
    messages = [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    body = {
        "messages": messages,
        "tools": [WEATHER],
        "tool_choice": "none",
        "chat_template": PROBE_TEMPLATE,
        "chat_template_kwargs": {"shout": True},
    }
    api = parse_chat(body, context)
    text = api.choices[0].request.prompt_text
    assert text == (
        "[tool get_weather]<user name=ann>Weather?<assistant>(call call_1 get_weather city=Oslo)"
        "<tool id=call_1>rain!<assistant>"
    )
    body = {**body, "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": None}
    body["messages"] = [*messages, {"role": "assistant", "content": "It rains"}]
    assert parse_chat(body, context).choices[0].request.prompt_text.endswith("<assistant>It rains")


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": ""}, "chat_template"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs a parser: this server has none
    ],
)
def test_bad_template_options_are_a_400_naming_the_field(context, extra, field):
    no_parser = Context(context.limits, context.tokenizer, ("tiny",))
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"messages": [{"role": "user", "content": "Hi"}], **extra}, no_parser)
    assert err.value.field == field


def test_a_request_template_needs_the_servers_trust(context):
    untrusting = Context(context.limits, context.tokenizer, ("tiny",))
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 1 }}"}, untrusting)
    assert err.value.field == "chat_template"


def test_priority_is_vllms_on_the_openai_front(context):
    """Lower is served first there; the router's priority (higher first, as over gRPC) is the negation."""
    for sent, routed in ((-5, 5), (0, 0), (7, -7)):
        body = {"messages": [{"role": "user", "content": "Hi"}], "priority": sent}
        assert parse_chat(body, context).choices[0].request.priority == routed
        assert parse_completion({"prompt": [1, 2], "priority": sent}, context).choices[0].request.priority == routed


def test_requests_without_tools_or_parsers_keep_the_text_as_it_is(context):
    plain = Context(context.limits, context.tokenizer, ("tiny",))
    assert parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, plain).output is None


def test_config_names_match_the_registries():
    assert set(TOOL_CALL_PARSERS) == set(tools.TOOL_CALL_PARSERS)
    assert set(REASONING_PARSERS) == set(reasoning.REASONING_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'kimi_k2'; known: hermes, llama3_json, mistral, pythonic, qwen3_coder, granite"):
        tools.tool_call_parser("kimi_k2")


def test_a_vllm_only_flag_fails_the_start_naming_it(capsys):
    from splitserve.serve import refuse_vllm_flags

    with pytest.raises(SystemExit) as err:
        refuse_vllm_flags("splitserve serve", ["--model", "m", "--tensor-parallel-size=2"])
    assert str(err.value.code) == "splitserve serve: --tensor-parallel-size is vLLM's and not supported here: use --tp (decode ranks)"
    refuse_vllm_flags("splitserve serve", ["--tool-call-parser", "hermes", "--api-key", "k"])  # shared flags pass


def test_the_api_key_and_the_token_file_are_one_token(tmp_path):
    from common.config import ConfigError
    from router.server import read_auth_token

    token_file = tmp_path / "token"
    token_file.write_text(" secret\n")
    assert read_auth_token(str(token_file)) == "secret"
    assert read_auth_token(None, "key") == "key" and read_auth_token(None) is None
    with pytest.raises(ConfigError, match="router.auth_token_file: SPLITSERVE_API_KEY is set too"):
        read_auth_token(str(token_file), "key")


def test_a_parser_whose_markers_are_special_tokens_gets_them_in_the_text(context):
    """`mistral` reads `[TOOL_CALLS]`, a special token in Mistral's tokenizers: its requests keep special
    tokens in their text unless they say otherwise (the stop token that ends them is still not rendered)."""
    from dataclasses import replace

    mistral = replace(context, tool_call_parser="mistral")
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}

    def skips(ctx, **extra) -> bool:
        return parse_chat({**body, **extra}, ctx).choices[0].request.params.skip_special_tokens

    assert skips(mistral) is False
    assert skips(mistral, skip_special_tokens=True) is True
    assert skips(mistral, tool_choice="none") is True  # nothing is parsed: the default stands
    assert skips(context) is True  # hermes' markers are plain text
    assert parse_chat({"messages": body["messages"]}, mistral).choices[0].request.params.skip_special_tokens
