"""Every tool-call parser on model text, without a server: what it finds (calls, content), and the same
result streamed however the text is cut into tokens, each call's arguments arriving as the model writes
them. Edge cases: nested JSON, strings holding brackets, quotes and the closing tag, tags cut across
tokens, several calls, malformed calls kept as content, calls cut short by max_tokens."""

from __future__ import annotations

import itertools
import json
import string
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.openai import tools
from router.openai.tool_stream import ChatOutput, OutputParsing

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "where": {"type": "object"},
                "hours": {"type": "array"},
                "code": {"type": "string"},
            },
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = tools.ToolRequest((WEATHER, TIME), "auto")

MARKER_IN_ARGUMENTS = '[TOOL_CALLS]get_time{"zone": [TOOL_CALLS]get_weather{"where": {"q": [1]}}'
# (parser, model text, content, [(name, arguments text)]): arguments are compared as text, since the
# text is what the stream's fragments must add up to.
CASES = [
    # ---- hermes ----
    (
        "hermes",
        (
            'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done <tool_call>not json</tool_call>'
        ),
        "Let me check. done <tool_call>not json</tool_call>",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    (
        "hermes",
        (
            '<tool_call>{"name": "run", "arguments": {"code": "print(\\"}</tool_call>]\\")", "n": [1, {"x": null}]}}'
            "</tool_call>"
        ),
        "",
        [("run", '{"code": "print(\\"}</tool_call>]\\")", "n": [1, {"x": null}]}')],
    ),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    (
        "hermes",
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>ok',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>ok',
        [],
    ),
    ("hermes", 'Hi <tool_call>{"name": "get_w', 'Hi <tool_call>{"name": "get_w', []),  # cut before decided
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "x', "", [("f", '{"a": "x')]),  # cut after
    ("hermes", "a < b <tool_ and <tool_call", "a < b <tool_ and <tool_call", []),
    # ---- llama3_json ----
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}; {"name": "get_time"}',
        "",
        [("get_weather", '{"city": "Oslo; Norway"}'), ("get_time", "{}")],
    ),
    ("llama3_json", '{"type": "function", "name": "f", "parameters": {"a": [1, 2]}}', "", [("f", '{"a": [1, 2]}')]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("llama3_json", '{"name": "f", "parameters": {}} Done.', "Done.", [("f", "{}")]),
    # ---- mistral ----
    (
        "mistral",
        (
            'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
            '"arguments": {}}]'
        ),
        "Sure. ",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "where": {"q": "[TOOL"}}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", '{"city": "Paris", "where": {"q": "[TOOL"}}'), ("get_time", "{}")],
    ),
    ("mistral", '[TOOL_CALLS]get_time{"zone": "utc"}', "", [("get_time", '{"zone": "utc"}')]),
    ("mistral", "[TOOL_CALLS]hello world", "[TOOL_CALLS]hello world", []),
    # the next marker inside open arguments: they end where it stands (its "[" is no bracket)
    (
        "mistral",
        MARKER_IN_ARGUMENTS,
        "",
        [("get_time", '{"zone": '), ("get_weather", '{"where": {"q": [1]}}')],
    ),
    ("mistral", '[TOOL_CALLS][{"name": 1}]', '[TOOL_CALLS][{"name": 1}]', []),
    ("mistral", "Lists look like [TOOLS] or [T", "Lists look like [TOOLS] or [T", []),
    # ---- pythonic ----
    (
        "pythonic",
        "[get_weather(city='Paris', days=3, metric=True), get_time()]",
        "",
        [("get_weather", '{"city": "Paris", "days": 3, "metric": true}'), ("get_time", "{}")],
    ),
    (
        "pythonic",
        "<|python_start|>[get_weather(code='a)b], \"it\\'s\"', where={'k': (1, -2.5, None)}, hours=[],)]<|python_end|>",
        "",
        [("get_weather", '{"code": "a)b], \\"it\'s\\"", "where": {"k": [1, -2.5, null]}, "hours": []}')],
    ),
    ("pythonic", "[see(below)] for more", "[see(below)] for more", []),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "[f(x=y)]", "[f(x=y)]", []),  # a value that is no literal: not a call
    ("pythonic", "[f(a=1, b=g(2))]", "b=g(2))]", [("f", '{"a": 1}')]),
    ("pythonic", "Sure: [f(a=1)]", "Sure: [f(a=1)]", []),
    ("pythonic", "[get_time(), get_weather(city='Li", "get_weather(city='Li", [("get_time", "{}")]),  # cut short
    ("pythonic", "[get_weather(city='Lima', days=2", "", [("get_weather", '{"city": "Lima"}')]),
    # ---- qwen3_coder ----
    (
        "qwen3_coder",
        (
            "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n<parameter=ratio>\n0.5\n"
            '</parameter>\n<parameter=where>\n{"lat": 1}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n'
            "<parameter=code>\n007\n</parameter>\n<parameter=extra>\n[1]\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
        ),
        "Checking.\n\n",
        [
            (
                "get_weather",
                (
                    '{"city": "New York", "days": 3, "metric": false, "ratio": 0.5, "where": {"lat": 1}, '
                    '"hours": [1, 2], "code": "007", "extra": [1]}'
                ),
            ),
            ("get_time", "{}"),
        ],
    ),
    (
        "qwen3_coder",
        (
            "<tool_call>\n<function=get_weather>\n<parameter=code>\nif a < b:\n    x = '<p>'\n</parameter>\n</function>"
            "\n</tool_call>"
        ),
        "",
        [("get_weather", json.dumps({"code": "if a < b:\n    x = '<p>'"}))],
    ),
    ("qwen3_coder", "<tool_call>oops</tool_call> fine", "<tool_call>oops</tool_call> fine", []),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n4",
        "",
        [("get_weather", '{"city": "Oslo"}')],  # cut short: the whole parameters only
    ),
    # ---- granite ----
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")],
    ),
    ("granite", '<tool_call> [{"arguments": {"a": "[x]"}, "name": "f"}] Done.', "Done.", [("f", '{"a": "[x]"}')]),
    ("granite", "[1, 2] is a list", "[1, 2] is a list", []),
    ("granite", "<|tool_call", "<|tool_call", []),
]
CUT_SHORT = ('"x', "'Li", "days=2", "\n4")  # texts ending so: max_tokens cut the last call
IDS = [f"{parser}-{i}" for i, (parser, *_) in enumerate(CASES)]


def _parsing(parser: str, request: tools.ToolRequest = TOOLS) -> OutputParsing:
    return OutputParsing(request, tools.tool_call_parser(parser, tools=request))


def _stream(parsing: OutputParsing, pieces: list[str]) -> tuple[dict, list[dict]]:
    """The pieces fed as a stream's steps, reassembled as the openai client does; also every call delta."""
    out = ChatOutput(parsing)
    content, calls, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        delta = out.delta(piece, i == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            deltas.append(call)
            entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": call["function"].get("name")})
            entry["arguments"] = entry.get("arguments", "") + call["function"].get("arguments", "")
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}, deltas


def _whole(parsing: OutputParsing, text: str) -> dict:
    message = ChatOutput(parsing).message(text)
    calls = [{"id": c["id"], **c["function"]} for c in message.get("tool_calls", [])]
    return {"content": message["content"] or "", "calls": calls}


def _without_ids(result: dict) -> dict:
    return {"content": result["content"], "calls": [(c["name"], c["arguments"]) for c in result["calls"]]}


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=IDS)
def test_each_parser_finds_the_calls_and_keeps_the_rest_as_content(parser, text, content, calls):
    whole = _whole(_parsing(parser), text)
    assert _without_ids(whole) == {"content": content, "calls": calls}
    finished = calls[:-1] if text.endswith(CUT_SHORT) else calls[1:] if text == MARKER_IN_ARGUMENTS else calls
    for _, arguments in finished:
        json.loads(arguments)  # the arguments of calls the model finished are JSON


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=IDS)
def test_streamed_deltas_reassemble_to_the_whole_response_at_every_cut(parser, text, content, calls):
    whole = _without_ids(_whole(_parsing(parser), text))
    for cut in range(1, min(len(text), 9) + 1):
        pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
        streamed, _ = _stream(_parsing(parser), pieces)
        assert _without_ids(streamed) == whole, cut


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_streaming_at_random_token_boundaries_matches_the_whole_response(case, cuts):
    parser, text, *_ = case
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    streamed, _ = _stream(_parsing(parser), pieces)
    assert _without_ids(streamed) == _without_ids(_whole(_parsing(parser), text))


# Pieces of every format, spliced into the cases' texts to make near-misses: cut tags, stray brackets and
# quotes, markers where no call can be.
NOISE = [
    "<tool_call>",
    "</tool_call>",
    "{",
    "}",
    "[",
    "]",
    '"',
    "'",
    "\\",
    ",",
    ":",
    ";",
    "(",
    ")",
    "=",
    " ",
    "\n",
    '"name"',
    '"arguments"',
    '"f"',
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "<|python_end|>",
    "<function=f>",
    "</function>",
    "<parameter=a>",
    "</parameter>",
    "<tool",
    "[TOOL",
    "get_time",
    "True",
    "1",
]
_EDIT = st.tuples(st.sampled_from(["cut", "drop", "insert", "repeat"]), st.floats(0, 1), st.sampled_from(NOISE))


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), edits=st.lists(_EDIT, min_size=1, max_size=3), cuts=st.lists(st.floats(0, 1)))
def test_damaged_calls_stream_as_they_parse_whole(case, edits, cuts):
    """Whatever the text (a call cut, a bracket lost, a tag in the wrong place), the stream adds up to the
    whole response: a parser never takes back what it has sent."""
    parser, text, *_ = case
    for edit, where, noise in edits:
        at = int(where * len(text))
        text = {
            "cut": text[:at],
            "drop": text[:at] + text[at + 3 :],
            "insert": text[:at] + noise + text[at:],
            "repeat": text + text,
        }[edit]
    bounds = sorted({0, len(text), *(int(c * len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    streamed, _ = _stream(_parsing(parser), pieces)
    assert _without_ids(streamed) == _without_ids(_whole(_parsing(parser), text))


@pytest.mark.parametrize(
    "parser, text, fragments",
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>', 8),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', 8),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', 8),
        ("pythonic", "[get_weather(city='Paris', days=3)]", 2),
        ("granite", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', 8),
        (
            "qwen3_coder",
            (
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
            ),
            3,
        ),
    ],
)
def test_auto_calls_stream_argument_by_argument(parser, text, fragments):
    """The first delta of a call names it (index, id, type, name), the arguments follow in fragments
    while the model writes them, not in one piece at the end."""
    parsing = _parsing(parser)
    streamed, deltas = _stream(parsing, list(text))  # one character per step
    first, *rest = deltas
    assert first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert first["id"] and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert len([d for d in deltas if d["function"].get("arguments")]) >= fragments
    assert json.loads(streamed["calls"][0]["arguments"]) == {"city": "Paris", "days": 3}
    out = ChatOutput(parsing)
    out.delta(text, True)
    assert out.finish_reason("stop") == "tool_calls"


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's templates refuse other ids when the calls come back in the history."""
    text = '[TOOL_CALLS]get_time{}[TOOL_CALLS]get_time{"zone": "utc"}'
    for result in (_whole(_parsing("mistral"), text), _stream(_parsing("mistral"), [text[:15], text[15:]])[0]):
        ids = [c["id"] for c in result["calls"]]
        assert len(ids) == 2 and len(set(ids)) == 2
        assert all(len(i) == 9 and set(i) <= set(string.ascii_letters + string.digits) for i in ids)
    assert _whole(_parsing("hermes"), '<tool_call>{"name": "f"}</tool_call>')["calls"][0]["id"].startswith("call_")


def test_qwen3_coder_values_without_a_schema_are_json_or_text():
    no_schemas = OutputParsing(TOOLS, tools.tool_call_parser("qwen3_coder"))
    text = "<tool_call><function=f><parameter=n>12</parameter><parameter=s>twelve</parameter></function></tool_call>"
    assert _whole(no_schemas, text)["calls"][0]["arguments"] == '{"n": 12, "s": "twelve"}'


def test_required_calls_stream_their_parameters_as_generated():
    parsing = OutputParsing(tools.ToolRequest((WEATHER, TIME), "required"))
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Kyiv", "days": 2}}, {"name": "get_time", "parameters": {}}]'
    )
    streamed, deltas = _stream(parsing, list(text))
    assert _without_ids(streamed) == _without_ids(_whole(parsing, text))
    assert [c["name"] for c in streamed["calls"]] == ["get_weather", "get_time"]
    assert json.loads(streamed["calls"][0]["arguments"]) == {"city": "Kyiv", "days": 2}
    assert len([d for d in deltas if d["index"] == 0]) > 10  # the parameters arrive while generated


def test_an_unknown_parser_fails_listing_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"router.tool_call_parser: unknown tool-call parser 'kimi_k2'; known: "
        r"hermes, llama3_json, mistral, pythonic, qwen3_coder, granite",
    ):
        tools.tool_call_parser("kimi_k2")


def test_the_serve_flag_lists_every_parser_and_refuses_others_in_one_line(tmp_path):
    """`splitserve serve --tool-call-parser` names the parsers in its help, and an unknown one ends the
    start with one line naming the key and the known names (no traceback)."""
    command = [sys.executable, "-m", "splitserve.cli", "serve"]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert all(name in " ".join(shown.split()) for name in tools.TOOL_CALL_PARSERS)
    refused = subprocess.run(
        [*command, "--model", str(tmp_path), "--tool-call-parser", "kimi_k2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        (
            "splitserve serve: router.tool_call_parser: must be null or one of "
            "['hermes', 'llama3_json', 'mistral', 'pythonic', 'qwen3_coder', 'granite']"
        )
    ]
