"""`mistral`: Mistral / Mixtral / Ministral / Devstral tool calls, after the `[TOOL_CALLS]` token.

Two shapes, as the tokenizer version writes them: a JSON list, `[TOOL_CALLS][{"name": ..., "arguments":
{...}}, ...]` (before v11), and one call per token, `[TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]
{...}` (v11 and later; `[ARGS]` may be absent from the text). Text before the first `[TOOL_CALLS]` is
content. Call ids are 9 letters and digits: Mistral's templates refuse other ids when the calls come back.
"""

from __future__ import annotations

import random
import re
import string

from router.openai.tool_parsers.base import Scan, ToolCall, ToolCallParser, hold_back, skip_space
from router.openai.tool_parsers.json_calls import Broken, CallsRead, Memo, read_calls, value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralParser(ToolCallParser):
    reads_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens from tokenizer v3 on

    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        first = text.find(MARKER)
        if first < 0:
            return Scan(text if final else hold_back(text, MARKER), ())
        content, calls = [text[:first]], list[ToolCall]()
        marker = first
        while True:
            read = _read_after_marker(text, skip_space(text, marker + len(MARKER)), final, memo)
            calls.extend(read.calls)
            if not read.calls:
                if read.state != "open" or final:  # no call after the marker: the text as written
                    content.append(text[marker:])
                break
            if read.state == "open":
                break
            rest = skip_space(text, read.end)
            if text.startswith(MARKER, rest):
                marker = rest
                continue
            if final or not MARKER.startswith(text[rest:]):  # not (the start of) the next call
                content.append(text[rest:])
            break
        return Scan("".join(content), tuple(calls))

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARACTERS, k=9))


def _read_after_marker(text: str, position: int, final: bool, memo: Memo | None) -> CallsRead:
    if position >= len(text):
        return CallsRead((), position, "broken" if final else "open")
    if text[position] == "[":
        return read_calls(text, position + 1, ("arguments",), final, closer="]", stop=MARKER, memo=memo)
    if text[position] == "{":  # one object without the list
        return read_calls(text, position, ("arguments",), final, stop=MARKER, memo=memo)
    return _read_named(text, position, final, memo)


def _read_named(text: str, position: int, final: bool, memo: Memo | None) -> CallsRead:
    """`name[ARGS]{...}`: the call is decided when its arguments open."""
    named = _NAME.match(text, position)
    if named is None:
        return CallsRead((), position, "broken")
    name, i = named.group(), named.end()
    if text.startswith(ARGS, i):
        i += len(ARGS)
    if ARGS.startswith(text[i:]):  # the name may still grow, or [ARGS] is cut, or the arguments are to come
        return CallsRead((), position, "broken" if final else "open")
    if text[i] != "{":
        return CallsRead((), position, "broken")
    try:
        end = value_end(text, i, stop=MARKER, memo=memo)
    except Broken as broken:  # decided: the arguments as written, up to the break
        end = broken.position
    if end is None:
        arguments = text[i:] if final else hold_back(text[i:], MARKER)
        return CallsRead((ToolCall(name, arguments),), len(text), "open")
    return CallsRead((ToolCall(name, text[i:end]),), end, "closed")
