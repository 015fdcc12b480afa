"""Tool calling on the chat endpoint: the request's `tools` and `tool_choice`, and the parsers that find
tool calls in a model's text.

`tools` is OpenAI's list of `{"type": "function", "function": {"name", "description", "parameters"}}`;
they reach the chat template as given (transformers' `apply_chat_template(tools=...)`). `tool_choice`:

- `"none"`: the text is the answer; nothing is parsed.
- `"auto"` (the default with tools): the model's text is searched for calls by the `--tool-call-parser`.
- `"required"`: the output is held to a JSON array of `{"name", "parameters"}` objects, one per call,
  naming the given tools (one call unless `parallel_tool_calls`).
- `{"type": "function", "function": {"name": N}}`: the output is held to N's `parameters` schema, the
  arguments of one call to N.

`required` and named choices are enforced with structured outputs (`engine.structured`), as vLLM does,
so their arguments always match the declared schema. Parsers live in `TOOL_CALL_PARSERS`; an unknown
name fails listing the known ones.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import NoReturn

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputSpec

TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function-name rule (dots and colons as vLLM allows)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""  # given when the call is sent (router.openai.tool_stream), stable across a stream's rescans

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat body's tools, as the template and the output parsing need them."""

    tools: tuple[dict, ...]  # as the client sent them (the template renders them)
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function a named choice forces
    parallel: bool = True  # parallel_tool_calls

    def schemas(self) -> dict[str, dict]:
        return {tool["function"]["name"]: _parameters(tool) for tool in self.tools}

    def structured_output(self) -> StructuredOutputSpec | None:
        """The output grammar `required` and named choices run under (vLLM's shapes); None otherwise."""
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutputSpec.json_schema(self.schemas()[self.name], field="tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in self.schemas().items()
        ]
        array: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputSpec.json_schema(array, field="tool_choice")


def parse_tools(body: dict) -> ToolRequest | None:
    """The body's tools and choice (None: no tools, nothing to parse); a bad one is a 400 naming its field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        _fail("parallel_tool_calls", "must be true or false")
    if tools is None or tools == []:
        if choice is not None and choice not in ("none", "auto"):
            _fail("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        _fail("tools", f"must be a list of at most {MAX_TOOLS} function tools")
    checked = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        _fail("tools", f"declares the function {duplicate!r} twice")
    if choice is None or choice in TOOL_CHOICES:
        return ToolRequest(checked, choice or "auto", parallel=parallel is not False)
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        named = '{"type": "function", "function": {"name": ...}}'
        _fail("tool_choice", f"must be one of {', '.join(TOOL_CHOICES)} or {named}")
    name = choice["function"].get("name")
    if name not in names:
        _fail("tool_choice.function.name", f"must name one of the tools: {', '.join(names)}")
    return ToolRequest(checked, "named", name, parallel is not False)


def _tool(tool, field: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        _fail(field, 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not _NAME.match(function["name"]):
        _fail(f"{field}.function.name", "must be 1-64 letters, digits, _ . : or -")
    if function.get("description") is not None and not isinstance(function["description"], str):
        _fail(f"{field}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        _fail(f"{field}.function.parameters", "must be a JSON schema (an object)")
    return tool


def _parameters(tool: dict) -> dict:
    parameters = tool["function"].get("parameters")
    return parameters if parameters is not None else {"type": "object"}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- parsing a model's text ----


@dataclass(frozen=True)
class Scan:
    """What a text holds so far: the content outside calls that can no longer change, and the calls
    complete so far. Both only grow as the text grows, which is what streaming relies on."""

    content: str
    calls: tuple[ToolCall, ...]


class ToolCallParser:
    """Finds calls in a model's text. `scan(text, final)`: with final False the text may still grow, so a
    marker cut at the end is held back and an open call is not yet a call."""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with text
    around them. A block that is not such JSON stays in the content, as written."""

    start, end = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while True:
            opened = text.find(self.start, position)
            if opened < 0:
                content.append(text[position:] if final else _hold_back(text[position:], self.start))
                break
            content.append(text[position:opened])
            closed = text.find(self.end, opened)
            if closed < 0:
                if final:  # an unfinished call (max_tokens): left as the text it is
                    content.append(text[opened:])
                break
            call = _call(text[opened + len(self.start) : closed], "arguments")
            if call is None:
                content.append(text[opened : closed + len(self.end)])
            else:
                calls.append(call)
            position = closed + len(self.end)
        return Scan("".join(content), tuple(calls))


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`), several joined with `;`. Any other answer is content. A call's JSON is only whole
    at the end, so a streamed answer that opens like a call is held back until then."""

    tag = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        body = body[len(self.tag) :].lstrip() if body.startswith(self.tag) else body
        looks_like_call = body.startswith("{") or (not final and (not body or self.tag.startswith(body)))
        if not looks_like_call:
            return Scan(text, ())
        if not final:
            return Scan("", ())
        calls = []
        for part in _split_top_level(body, ";"):
            call = _call(part, "parameters")
            if call is None:
                return Scan(text, ())
            calls.append(call)
        return Scan("", tuple(calls))


def _call(text: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, char in enumerate(text):
        if in_string:
            escaped = char == "\\" and not escaped
            in_string = escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


def _hold_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker` (it may complete with the next token)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:keep]):
            return text[:-keep]
    return text


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_call_parser(name: str, key: str = "router.tool_call_parser") -> ToolCallParser:
    parser = TOOL_CALL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"{key}: unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return parser()


def forced_calls(text: str, tools: ToolRequest) -> tuple[ToolCall, ...]:
    """The calls of a `required` or named choice's output (held to the grammar, so it parses; a text cut
    by max_tokens does not, and is then no call)."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    if tools.choice == "named":
        assert tools.name is not None
        return (ToolCall(tools.name, json.dumps(value, ensure_ascii=False)),)
    if not isinstance(value, list):
        return ()
    return tuple(
        ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for item in value
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    )


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)
