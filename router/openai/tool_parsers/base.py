"""The contract every tool-call parser keeps, so that one streaming path serves them all.

`scan(text, final)` reads a model's text (the part after any reasoning) and returns a `Scan`: the content
outside calls that can no longer change, and the calls found so far. While `final` is False the text may
still grow, so a marker cut at the end is held back and a call may be open: the last call can carry only
the start of its arguments. As the text grows, a scan only extends the one before it: the content grows at
its end, calls are appended, a call's name never changes and its arguments grow at their end. Streaming
(`router.openai.tool_stream`) sends what grew between two scans, so the deltas reassemble to the whole
response. A call is decided once its name and the start of its arguments are read; text that is not a
call before that point stays content, as written.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it (so far, while a call is open)
    id: str = ""  # given when the call is sent (router.openai.tool_stream), stable across a stream's rescans

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Scan:
    """What a text holds so far: the content outside calls that can no longer change, and the calls so
    far (the last may still be open). Both only grow as the text grows, which is what streaming relies on."""

    content: str
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Finds calls in a model's text (the module docstring states the contract).

    `schemas` maps each declared function's name to its `parameters` JSON schema: formats whose arguments
    are not JSON (XML-like parameters) convert values by it.

    `reads_special_tokens`: the format's markers are special tokens in its family's tokenizers (Mistral's
    `[TOOL_CALLS]`), which the text leaves out by default; a request this parser reads is rendered with
    `skip_special_tokens` false unless it sets the field (the stop token that ends it is still not
    rendered: engine.stop_checker.hides_stop_token)."""

    reads_special_tokens = False

    def __init__(self, schemas: dict[str, dict] | None = None):
        self.schemas = schemas or {}

    def scan(self, text: str, final: bool, memo: dict | None = None) -> Scan:
        """`memo`: a dict the caller keeps for one growing text (a choice's stream; None for a one-off
        scan), where the parser notes how far it read, so each step reads on instead of from the start."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        """The id a call is sent with (a family's template may check the shape of ids it gets back)."""
        return new_call_id()


def hold_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker` (it may complete with the next token)."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:keep]):
            return text[:-keep]
    return text


def cut_marker(text: str, marker: str) -> bool:
    """Whether `text` ends with a proper start of `marker`."""
    return hold_back(text, marker) != text


def skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


@dataclass(frozen=True)
class BlockRead:
    """A call read from inside a block: `call` None and `decided` False while more text could make one."""

    call: ToolCall | None
    end: int | None  # where the call's own text ended; None: still open
    decided: bool = True


def scan_blocks(text: str, final: bool, start: str, end: str, read) -> Scan:
    """Calls each in a `start` ... `end` block (hermes, qwen3_coder), any number, with text around them.
    `read(text, position, final) -> BlockRead` reads the call at a block's body. A block that is no call
    stays in the content, as written; so does one cut short before it was decided."""
    content: list[str] = []
    calls: list[ToolCall] = []
    position = 0
    while True:
        opened = text.find(start, position)
        if opened < 0:
            content.append(text[position:] if final else hold_back(text[position:], start))
            break
        content.append(text[position:opened])
        body = skip_space(text, opened + len(start))
        found = read(text, body, final) if body < len(text) else BlockRead(None, None, decided=final)
        if found.call is not None:
            calls.append(found.call)
            closed = -1 if found.end is None else text.find(end, found.end)
            if closed < 0:  # open, or no closing tag (yet): what follows the call is inside its block
                break
            position = closed + len(end)
            continue
        closed = text.find(end, opened + len(start))
        if closed < 0 or not found.decided:
            if final:
                content.append(text[opened:])
            break
        content.append(text[opened : closed + len(end)])
        position = closed + len(end)
    return Scan("".join(content), tuple(calls))
