"""`granite`: IBM Granite 3.x tool calls. The answer is a JSON list of calls, `[{"name": ..., "arguments":
{...}}, ...]`, after `<|tool_call|>` (Granite 3.0) or `<tool_call>` (3.1), or bare. An answer that does
not open with the list is content; so is text after the list."""

from __future__ import annotations

from router.openai.tool_parsers.base import Scan, ToolCallParser, skip_space
from router.openai.tool_parsers.json_calls import read_calls

TAGS = ("<|tool_call|>", "<tool_call>")


class GraniteParser(ToolCallParser):
    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        start = skip_space(text, 0)
        for tag in TAGS:
            if text.startswith(tag, start):
                start = skip_space(text, start + len(tag))
                break
        else:
            if not final and any(tag.startswith(text[start:]) for tag in TAGS):  # nothing yet, or a tag cut
                return Scan("", ())
        if start >= len(text):
            return Scan(text if final else "", ())
        if text[start] != "[":
            return Scan(text, ())
        read = read_calls(text, start + 1, ("arguments",), final, closer="]", memo=memo)
        if not read.calls:
            return Scan(text if read.state != "open" or final else "", ())
        return Scan("" if read.state == "open" else text[skip_space(text, read.end) :], read.calls)
