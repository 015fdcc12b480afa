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
so their arguments always match the declared schema. Parsers live in `TOOL_CALL_PARSERS`
(`router.openai.tool_parsers`, one module each); an unknown name fails listing the known ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputSpec
from router.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    Scan,
    ToolCall,
    ToolCallParser,
)
from router.openai.tool_parsers.base import new_call_id, skip_space
from router.openai.tool_parsers.json_calls import read_calls

# Re-exported: the chat and responses routes take the parsing API from this module.
__all__ = [
    "TOOL_CALL_PARSERS",
    "GraniteParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Qwen3CoderParser",
    "Scan",
    "ToolCall",
    "ToolCallParser",
    "ToolRequest",
    "forced_calls",
    "forced_scan",
    "new_call_id",
    "parse_tools",
    "tool_call_parser",
]

TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function-name rule (dots and colons as vLLM allows)


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


# ---- parsing a model's text: the parsers are in router.openai.tool_parsers ----


def tool_call_parser(
    name: str, key: str = "router.tool_call_parser", tools: ToolRequest | None = None
) -> ToolCallParser:
    """The parser named `name` for a request's `tools` (their schemas type the arguments of formats that
    are not JSON); an unknown name fails listing the known ones, `key` naming where it came from."""
    parser = TOOL_CALL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"{key}: unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return parser(tools.schemas() if tools is not None else None)


def forced_scan(text: str, final: bool, memo: dict | None = None) -> tuple[ToolCall, ...]:
    """The calls of a `required` choice's output so far: the JSON array the grammar holds it to, each
    call's `parameters` as generated (a text cut by max_tokens keeps the calls begun). `memo` as a
    parser's scan takes it."""
    start = skip_space(text, 0)
    if start >= len(text) or text[start] != "[":
        return ()
    return read_calls(text, start + 1, ("parameters",), final, closer="]", memo=memo).calls


def forced_calls(text: str, tools: ToolRequest) -> tuple[ToolCall, ...]:
    """The calls of a `required` or named choice's whole output."""
    if tools.choice == "named":
        assert tools.name is not None
        return (ToolCall(tools.name, text.lstrip()),) if text.strip() else ()
    return forced_scan(text, final=True)


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)
