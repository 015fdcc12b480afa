"""`llama3_json`: Llama 3.1-3.3 JSON tool calls. The answer is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several joined with `;`. An answer that does not open with such an
object is content; text after the calls that is not another call is content too."""

from __future__ import annotations

from router.openai.tool_parsers.base import Scan, ToolCallParser, skip_space
from router.openai.tool_parsers.json_calls import read_calls

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        start = skip_space(text, 0)
        if text.startswith(TAG, start):
            start = skip_space(text, start + len(TAG))
        elif not final and TAG.startswith(text[start:]):  # nothing yet, or the tag cut
            return Scan("", ())
        if start >= len(text):
            return Scan(text if final else "", ())
        if text[start] != "{":
            return Scan(text, ())
        read = read_calls(text, start, ("parameters", "arguments"), final, separator=";", memo=memo)
        if not read.calls:
            return Scan(text if read.state == "broken" or final else "", ())
        return Scan(text[read.end :] if read.state == "broken" else "", read.calls)
