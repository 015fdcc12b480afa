"""Each `--tool-call-parser` through a served model with the real `openai` client: a tiny checkpoint trained
to answer each parser's prompt in that parser's format (greedy tokens equal HF's, so the text is known),
the calls parsed from it whole and streamed, the stream reassembled equal to the whole response."""

from __future__ import annotations

import json
import string

import openai
import pytest

from router.openai import HttpFront
from tests.router.conftest import router_config, start_router
from tests.scripted_checkpoint import make_scripted_checkpoint, scripted_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# parser → (what the model is trained to answer, the content, the calls parsed from it)
ANSWERS = {
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}',
        None,
        [("get_weather", {"city": "Oslo", "unit": "c"})],
    ),
    "mistral": (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Lima", "days": 3}',
        "Checking.",
        [("get_weather", {"city": "Lima", "days": 3})],
    ),
    "pythonic": (
        "[get_weather(city='Oslo', unit='f'), get_time()]",
        None,
        [("get_weather", {"city": "Oslo", "unit": "f"}), ("get_time", {})],
    ),
    "granite": (
        '<|tool_call|>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
        None,
        [("get_time", {}), ("get_weather", {"city": "Rome"})],
    ),
    "qwen3_coder": (
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
            "4\n</parameter>\n</function>\n</tool_call>"
        ),
        None,
        [("get_weather", {"city": "Paris", "days": 4})],
    ),
}


def _ask(parser: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather, {parser}?"}]


@pytest.fixture(scope="module")
def fronts(ray_session, tmp_path_factory):
    """One router over the trained checkpoint, an HTTP front per parser."""
    folder = tmp_path_factory.mktemp("parsers", numbered=False)
    tokenizer = scripted_tokenizer()
    scripts = [
        (tokenizer.apply_chat_template(_ask(p), tokenize=False, add_generation_prompt=True), answer)
        for p, (answer, _, _) in ANSWERS.items()
    ]
    make_scripted_checkpoint(folder, scripts)
    stack = start_router(folder, router_config(tool_call_parser="mistral"))
    started = {
        parser: stack.loop.call(
            HttpFront.start(
                stack.server.service, host="127.0.0.1", port=0, model_names=("parsers",), tool_call_parser=parser
            )
        )
        for parser in ANSWERS
        if parser != "mistral"
    }
    yield {"mistral": stack.server.http, **started}
    for http in started.values():
        stack.loop.call(http.stop(grace_s=1.0))
    stack.stop()


def _reassemble(chunks) -> tuple[dict, list]:
    """A stream's deltas put together as agent frameworks do it; also every tool-call delta."""
    out: dict = {"content": "", "calls": {}, "finish": None}
    deltas = []
    for chunk in chunks:
        for choice in chunk.choices:
            out["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                deltas.append(call)
                entry = out["calls"].setdefault(
                    call.index, {"id": call.id, "name": call.function.name, "arguments": ""}
                )
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out, deltas


@pytest.mark.parametrize("parser", list(ANSWERS))
def test_each_parser_finds_the_models_calls_whole_and_streamed_alike(fronts, parser):
    answer, content, expected = ANSWERS[parser]
    with openai.OpenAI(base_url=f"{fronts[parser].url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        untouched = sdk.chat.completions.create(model="parsers", messages=_ask(parser), temperature=0.0)
        whole = sdk.chat.completions.create(
            model="parsers", messages=_ask(parser), tools=[WEATHER, TIME], temperature=0.0
        )
        streamed, deltas = _reassemble(
            sdk.chat.completions.create(
                model="parsers", messages=_ask(parser), tools=[WEATHER, TIME], temperature=0.0, stream=True
            )
        )
    assert untouched.choices[0].message.content == answer  # without tools the text is the answer
    choice = whole.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [(name, json.loads(arguments)) for name, arguments in calls] == expected
    assert choice.message.content == content and choice.finish_reason == "tool_calls"
    # The stream adds up to the same message: content, each call's name and arguments text.
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == calls
    assert streamed["content"] == (content or "") and streamed["finish"] == "tool_calls"
    # A call's first delta names it; the ones after carry only argument fragments.
    for index in range(len(calls)):
        first, *rest = [d for d in deltas if d.index == index]
        assert first.id and first.type == "function" and first.function.name == calls[index][0]
        assert all(d.id is None and d.function.name is None for d in rest)
    ids = [c.id for c in choice.message.tool_calls] + [c["id"] for c in streamed["calls"]]
    if parser == "mistral":  # Mistral's templates take back only 9-character alphanumeric ids
        assert all(len(i) == 9 and set(i) <= set(string.ascii_letters + string.digits) for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)
