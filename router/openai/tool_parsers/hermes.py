"""`hermes`: Hermes 2 Pro / Qwen 2.5 / Qwen 3 tool calls, each `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, any number, with text around them (the content)."""

from __future__ import annotations

from router.openai.tool_parsers.base import BlockRead, Scan, ToolCallParser, scan_blocks
from router.openai.tool_parsers.json_calls import read_object

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        def read(text: str, position: int, final: bool) -> BlockRead:
            if text[position] != "{":
                return BlockRead(None, None)
            found = read_object(text, position, ("arguments", "parameters"), final, stop=END, memo=memo)
            return BlockRead(found.call, found.end, found.decided)

        return scan_blocks(text, final, START, END, read)
