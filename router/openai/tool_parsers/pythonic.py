"""`pythonic`: tool calls written as a Python list of calls, `[get_weather(city="Paris"), get_time()]`
(Llama 3.2 / 4, ToolACE), optionally between `<|python_start|>` and `<|python_end|>`.

The answer must open with the list; keyword arguments only, each a Python literal (strings, numbers,
True/False/None, lists, tuples, dicts), read with `ast.parse`, never evaluated. A call is decided at
its first whole `keyword=literal` (or at `name()`), and its arguments are sent as JSON one argument at a
time, as each value completes. An answer that is no such list is content; so is what follows a decided
call's argument that is no literal.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from router.openai.tool_parsers.base import Scan, ToolCall, ToolCallParser, skip_space
from router.openai.tool_parsers.json_calls import CallsRead

START, END = "<|python_start|>", "<|python_end|>"
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON's spellings, which models mix in
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_STRUCTURE = re.compile(r"""[()\[\]{},'"]""")
# A quoted string's body up to its closing quote or the text's end (never stopping inside an escape).
_STRINGS = {quote: re.compile(rf"(?:[^{quote}\\]++|\\.)*+", re.DOTALL) for quote in "'\""}


class PythonicParser(ToolCallParser):
    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        start = skip_space(text, 0)
        if text.startswith(START, start):
            start = skip_space(text, start + len(START))
        elif not final and START.startswith(text[start:]):
            return Scan("", ())
        if start >= len(text):
            return Scan(text if final else "", ())
        if text[start] != "[":
            return Scan(text, ())
        read = _read_list(text, start + 1, final, memo)
        if not read.calls:
            return Scan(text if read.state != "open" or final else "", ())
        if read.state == "open":
            return Scan("", read.calls)
        rest = skip_space(text, read.end)
        if read.state == "closed" and text.startswith(END, rest):
            rest = skip_space(text, rest + len(END))
        elif read.state == "closed" and not final and END.startswith(text[rest:]):
            return Scan("", read.calls)
        return Scan(text[rest:], read.calls)


@dataclass(frozen=True)
class _CallRead:
    call: ToolCall | None
    end: int | None  # after ")" or where the call broke off; None: open
    decided: bool = True


def _read_list(text: str, i: int, final: bool, memo: dict | None) -> CallsRead:
    calls: list[ToolCall] = []
    while True:
        i = skip_space(text, i)
        if i < len(text) and text[i] == "]":
            return CallsRead(tuple(calls), i + 1, "closed")
        if i < len(text) and calls:
            if text[i] != ",":
                return CallsRead(tuple(calls), i, "broken")
            i = skip_space(text, i + 1)
            if i < len(text) and text[i] == "]":
                return CallsRead(tuple(calls), i + 1, "closed")
        if i >= len(text):
            return CallsRead(tuple(calls), i, "open")
        read = _read_call(text, i, final, memo)
        if read.call is None:
            return CallsRead(tuple(calls), i, "broken" if read.decided else "open")
        calls.append(read.call)
        if read.end is None:
            return CallsRead(tuple(calls), len(text), "open")
        i = read.end


def _read_call(text: str, start: int, final: bool, memo: dict | None) -> _CallRead:
    named = _IDENTIFIER.match(text, start)
    if named is None:
        return _CallRead(None, start)
    i = named.end()
    if i >= len(text):
        return _CallRead(None, None, decided=final)
    if text[i] != "(":
        return _CallRead(None, start)
    name, members, decided = named.group(), list[str](), False
    i += 1

    def result(end: int | None) -> _CallRead:
        """The call so far; `end` None: open (closed all the same at the end of the text)."""
        if not decided:
            return _CallRead(None, end, decided=end is not None or final)
        arguments = "{" + ", ".join(members) + ("}" if end is not None or final else "")
        return _CallRead(ToolCall(name, arguments), end)

    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return result(None)
        if text[i] == ")":
            decided = True
            return result(i + 1)
        if members:
            if text[i] != ",":
                return result(i)
            i = skip_space(text, i + 1)
            if i < len(text) and text[i] == ")":
                return result(i + 1)
        keyword = _IDENTIFIER.match(text, i)
        if keyword is None or keyword.end() >= len(text):
            return result(None if i >= len(text) or keyword is not None else i)
        equals = skip_space(text, keyword.end())
        if equals >= len(text):
            return result(None)
        if text[equals] != "=":  # a positional argument: not the shape of a call
            return result(i)
        value_start = skip_space(text, equals + 1)
        value_stop = _value_stop(text, value_start, memo) if value_start < len(text) else None
        if value_stop is None:
            return result(None)
        value = _literal(text[value_start:value_stop])
        if value is _NOT_LITERAL:
            return result(i)
        members.append(f"{json.dumps(keyword.group())}: {json.dumps(value, ensure_ascii=False)}")
        decided, i = True, value_stop


def _value_stop(text: str, start: int, memo: dict | None) -> int | None:
    """Where the argument value starting at `start` ends: the "," or ")" after it, outside brackets and
    strings (None: the text ends first; `memo` keeps how far it got, to read on from there)."""
    key = ("python", start)
    i, opened = memo.get(key, (start, ())) if memo is not None else (start, ())
    stack = list(opened)
    while (found := _STRUCTURE.search(text, i)) is not None:
        char, i = found.group(), found.start()
        if char in _STRINGS:
            string_key = ("python string", i)
            resume = memo.get(string_key, i + 1) if memo is not None else i + 1
            rest = _STRINGS[char].match(text, resume)
            assert rest is not None  # the pattern matches the empty string
            if rest.end() >= len(text) or text[rest.end()] != char:  # unterminated (or a lone "\" last)
                if memo is not None:
                    memo[string_key] = rest.end()
                break
            i = rest.end() + 1
            continue
        if char in _CLOSERS:
            stack.append(_CLOSERS[char])
        elif char == "," and not stack:
            return i
        elif char in ")]}" and (not stack or stack.pop() != char):
            return i  # the call's end, or unbalanced: the literal check refuses it
        i += 1
    else:
        i = len(text)
    if memo is not None:
        memo[key] = (i, tuple(stack))
    return None


_NOT_LITERAL = object()


def _literal(source: str) -> object:
    """The JSON value of a Python literal's source; _NOT_LITERAL for anything else."""
    try:
        return _value(ast.parse(source.strip(), mode="eval").body)
    except (SyntaxError, ValueError):
        return _NOT_LITERAL


def _value(node: ast.expr) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(element) for element in node.elts]
    if isinstance(node, ast.Dict) and all(key is not None for key in node.keys):
        keys = [_value(key) for key in node.keys if key is not None]
        if all(isinstance(key, str) for key in keys):
            return dict(zip(keys, (_value(v) for v in node.values), strict=True))
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError("not a literal")
