"""`qwen3_coder`: Qwen3-Coder's XML-like tool calls, any number, with text around them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A call is decided when `<function=NAME>` is read; its arguments are sent as JSON one parameter at a time,
as each `</parameter>` arrives. A value's text (one newline either side dropped) becomes the JSON type
its tool's schema declares for that parameter (`CONVERTERS`); a parameter the schema does not declare is
JSON when it parses as JSON, else a string.
"""

from __future__ import annotations

import json
import re

from router.openai.tool_parsers.base import BlockRead, Scan, ToolCall, ToolCallParser, scan_blocks

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_INTEGER = re.compile(r"[-+]?\d+")
_MISSING = object()


def _json_of(kind: type | tuple[type, ...]):
    def convert(text: str) -> object:
        try:
            value = json.loads(text)
        except ValueError:
            return _MISSING
        return value if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)) else _MISSING

    return convert


# A JSON schema type → how a parameter's text becomes that type (_MISSING: it does not).
CONVERTERS = {
    "string": lambda text: text,
    "integer": lambda text: int(text) if _INTEGER.fullmatch(text.strip()) else _MISSING,
    "number": _json_of((int, float)),
    "boolean": lambda text: {"true": True, "false": False}.get(text.strip().lower(), _MISSING),
    "null": lambda text: None if text.strip().lower() in ("null", "none") else _MISSING,
    "object": _json_of(dict),
    "array": _json_of(list),
}


class Qwen3CoderParser(ToolCallParser):
    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        return scan_blocks(text, final, START, END, self._read)

    def _read(self, text: str, position: int, final: bool) -> BlockRead:
        if not text.startswith(FUNCTION, position):
            cut = FUNCTION.startswith(text[position:])
            return BlockRead(None, None, decided=final or not cut)
        named = text.find(">", position + len(FUNCTION))
        if named < 0:
            return BlockRead(None, None, decided=final)
        name = text[position + len(FUNCTION) : named].strip()
        if not name or "<" in name or "\n" in name:
            return BlockRead(None, position)
        members: list[str] = []
        i = named + 1
        while True:
            parameter, closed = text.find(PARAMETER, i), text.find(FUNCTION_END, i)
            if closed >= 0 and (parameter < 0 or closed < parameter):
                return BlockRead(ToolCall(name, "{" + ", ".join(members) + "}"), closed + len(FUNCTION_END))
            value_at = text.find(">", parameter + len(PARAMETER)) + 1 if parameter >= 0 else 0
            ends = [
                at for at in (text.find(mark, value_at) for mark in (PARAMETER_END, PARAMETER, FUNCTION_END)) if at >= 0
            ]
            if parameter < 0 or value_at == 0 or not ends:  # the next parameter is not whole yet
                return BlockRead(ToolCall(name, "{" + ", ".join(members) + ("}" if final else "")), None)
            key = text[parameter + len(PARAMETER) : value_at - 1].strip()
            value = self.convert(name, key, _strip_newline(text[value_at : min(ends)]))
            members.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            i = min(ends) + (len(PARAMETER_END) if text.startswith(PARAMETER_END, min(ends)) else 0)

    def convert(self, function: str, parameter: str, text: str) -> object:
        schema = self.schemas.get(function, {}).get("properties", {}).get(parameter)
        declared = schema.get("type") if isinstance(schema, dict) else None
        kinds = declared if isinstance(declared, list) else [declared] if isinstance(declared, str) else []
        for kind in kinds:
            value = CONVERTERS.get(kind, CONVERTERS["string"])(text)
            if value is not _MISSING:
                return value
        if "string" in kinds:
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


def _strip_newline(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text
