"""Reading JSON tool calls, `{"name": ..., "arguments": {...}}`, from a text that may still grow.

A call is decided once its name is read and its arguments object has opened (or, for other key orders,
once the object closes): from then on its arguments are the model's own JSON text, sent as it grows. A
call decided and then cut short (max_tokens) stays a call with the arguments written so far. Before that
point nothing is decided: the reader says whether more text could still make a call. Used by the hermes,
llama3_json, mistral and granite parsers and by `tool_choice: "required"` (a JSON array of calls).

A stream rescans its text at every token; with a `Memo` the scan of a string or value still open reads
on from where the last one stopped, so a long argument costs once, not once per token.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from router.openai.tool_parsers.base import ToolCall, hold_back, skip_space

# Where scans of one growing text got to (a choice's stream keeps one): the text only grows, so a string or
# value still open at the last scan is read on from there instead of from its start.
Memo = dict[tuple[str, int], Any]


class Broken(ValueError):
    """The text cannot be JSON here (a closing bracket that does not match)."""

    def __init__(self, position: int):
        super().__init__(position)
        self.position = position


@dataclass(frozen=True)
class ObjectRead:
    call: ToolCall | None  # None: not a call (decided) or not yet known (undecided)
    end: int | None  # after the object's "}" or where it broke off; None: still open
    decided: bool = True  # False: more text could still make this a call


@dataclass(frozen=True)
class CallsRead:
    calls: tuple[ToolCall, ...]
    end: int  # after the closer, or where the text stopped being calls
    state: Literal["open", "closed", "broken"]  # open: the text ended inside; broken: text[end:] is no call


# A string's body from where its scan resumes: it stops at the closing quote, or at the text's end (never
# inside an escape, so a scan can resume there). Possessive: linear on any text.
_STRING_PART = re.compile(r'(?:[^"\\]++|\\.)*+', re.DOTALL)


@functools.lru_cache(maxsize=16)
def _structure(stop: str | None) -> re.Pattern[str]:
    """The characters a value's end depends on (and the format's closing tag): what lies between them is
    skipped at C speed."""
    return re.compile((re.escape(stop) + "|" if stop else "") + r'[\[\]{}"]')


def string_end(text: str, position: int, memo: Memo | None = None) -> int | None:
    """After the JSON string opening at `position`; None while it is unterminated."""
    key = ("string", position)
    run = _STRING_PART.match(text, memo.get(key, position + 1) if memo is not None else position + 1)
    assert run is not None  # the pattern matches the empty string
    if run.end() < len(text) and text[run.end()] == '"':
        return run.end() + 1
    if memo is not None:
        memo[key] = run.end()
    return None


def value_end(text: str, position: int, stop: str | None = None, memo: Memo | None = None) -> int | None:
    """After the JSON value starting at `position` (None: the text ends first). `stop` outside strings
    (the format's closing tag) ends an unbalanced value where it stands."""
    if text[position] == '"':
        return string_end(text, position, memo)
    if text[position] not in "[{":
        i = position
        while i < len(text) and text[i] not in ",}]" and not text[i].isspace():
            if stop and text.startswith(stop, i):
                break
            i += 1
        return i if i < len(text) else None  # a number at the end may still grow
    key = ("value", position)
    i, opened = memo.get(key, (position, ())) if memo is not None else (position, ())
    stack = list(opened)
    structure = _structure(stop)
    # A closing tag could still begin at `bound` or later: the scan resumes at or before it.
    bound = len(text) - len(stop) + 1 if stop else len(text)
    resume = (i, opened)
    while (found := structure.search(text, i)) is not None:
        char, i = found.group(), found.start()
        if i <= bound:
            resume = (i, tuple(stack))
        if char == '"':
            end = string_end(text, i, memo)
            if end is None:
                break
            i = end
            continue
        if len(char) > 1:  # the closing tag
            return i
        if char in "[{":
            stack.append("]" if char == "[" else "}")
        elif stack.pop() != char:
            raise Broken(i)
        elif not stack:
            return i + 1
        i += 1
    else:
        resume = (i, tuple(stack)) if i <= bound else resume
    if memo is not None:
        memo[key] = resume
    return None


def read_object(
    text: str,
    start: int,
    argument_keys: tuple[str, ...],
    final: bool,
    stop: str | None = None,
    memo: Memo | None = None,
) -> ObjectRead:
    """The call in the JSON object opening at `text[start]` ("{"). Keys other than "name" and the
    arguments' are skipped (some models write "type": "function" first)."""
    name: str | None = None
    arguments: str | None = None  # the arguments value's text, once complete
    i, first = start + 1, True
    try:
        while True:
            i = skip_space(text, i)
            if i < len(text) and text[i] == "}":
                return _settled(name, arguments, i + 1, closed=True)
            if i < len(text) and not first:
                if text[i] != ",":
                    return _settled(name, arguments, i, closed=False)
                i = skip_space(text, i + 1)
            if i >= len(text):
                return _open(name, arguments, final)
            first = False
            if text[i] != '"':
                return _settled(name, arguments, i, closed=False)
            key_end = string_end(text, i, memo)
            if key_end is None:
                return _open(name, arguments, final)
            key = json.loads(text[i:key_end])
            i = skip_space(text, key_end)
            if i < len(text) and text[i] != ":":
                return _settled(name, arguments, i, closed=False)
            i = skip_space(text, i + 1)
            if i >= len(text):
                return _open(name, arguments, final)
            streamed = key in argument_keys and name is not None and arguments is None and text[i] == "{"
            try:
                end = value_end(text, i, stop, memo)
            except Broken as broken:  # a decided call keeps the arguments as written, up to the break
                return _settled(name, text[i : broken.position] if streamed else arguments, broken.position, False)
            if end is None and streamed:  # the call's arguments, still open: sent as they come
                assert name is not None
                so_far = text[i:] if final or stop is None else hold_back(text[i:], stop)
                return ObjectRead(ToolCall(name, so_far), None)
            if end is None:
                return _open(name, arguments, final)
            value = text[i:end]
            if key == "name":
                if name is not None or not value.startswith('"'):
                    return _settled(name, arguments, i, closed=False)
                name = json.loads(value)
            elif key in argument_keys and arguments is None:
                arguments = value
            i = end
    except ValueError:  # a key or name that is no JSON string
        return _settled(name, arguments, i, closed=False)


def _arguments(value: str | None) -> str | None:
    """The arguments' JSON text: the object as written, or the object a JSON string holds (some models
    encode the arguments twice); None: not arguments."""
    if value is None or value.startswith("{"):
        return value
    try:
        inner = json.loads(value)
        return inner if isinstance(inner, str) and isinstance(json.loads(inner), dict) else None
    except ValueError:
        return None


def _settled(name: str | None, arguments: str | None, end: int, closed: bool) -> ObjectRead:
    """The object closed (or broke off at `end`): a call when it named one."""
    if name is None or (arguments is None and not closed):
        return ObjectRead(None, end)
    text = "{}" if arguments is None else _arguments(arguments)
    return ObjectRead(None if text is None else ToolCall(name, text), end)


def _open(name: str | None, arguments: str | None, final: bool) -> ObjectRead:
    text = _arguments(arguments)
    if name is not None and text is not None:  # decided: only the closing brace is missing
        return ObjectRead(ToolCall(name, text), None)
    return ObjectRead(None, None, decided=final)


def read_calls(
    text: str,
    start: int,
    argument_keys: tuple[str, ...],
    final: bool,
    separator: str = ",",
    closer: str | None = None,
    stop: str | None = None,
    memo: Memo | None = None,
) -> CallsRead:
    """Call objects from `start`, one after another with `separator` between them, until `closer` (a
    list's "]") or the first text that is not a call."""
    calls: list[ToolCall] = []
    i = start
    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return CallsRead(tuple(calls), i, "open")
        if closer is not None and text[i] == closer:
            return CallsRead(tuple(calls), i + 1, "closed")
        if calls:
            if text[i] != separator:
                return CallsRead(tuple(calls), i, "broken")
            i = skip_space(text, i + 1)
            if i >= len(text):
                return CallsRead(tuple(calls), i, "open")
        if text[i] != "{":
            return CallsRead(tuple(calls), i, "broken")
        read = read_object(text, i, argument_keys, final, stop, memo)
        if read.call is None:
            return CallsRead(tuple(calls), i, "broken" if read.decided else "open")
        calls.append(read.call)
        if read.end is None:
            return CallsRead(tuple(calls), len(text), "open")
        i = read.end
