"""One chat choice's text → OpenAI's message parts: `reasoning_content`, `content` and `tool_calls`, whole or
as stream deltas.

The text goes through the reasoning parser (when the router has one), then what is left through tool
parsing (`router.openai.tools`: the `--tool-call-parser` for `auto`, the forced JSON for `required` and a
named choice). Streaming rescans the whole text at each step and sends what grew since the last delta:
the parsers' outputs only grow (`router.openai.tool_parsers.base`), so the deltas reassemble to the
whole response. A call is sent as OpenAI streams them: its first delta carries `index`, `id`, `type` and
`function.name` (and the arguments so far), later ones `index` and argument fragments, as the model
writes them: JSON arguments as raw text, other formats one argument at a time. `required` calls stream
the same way from the JSON array the grammar holds the output to, a named choice's as generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.openai.reasoning import ReasoningParser
from router.openai.tools import ToolCall, ToolCallParser, ToolRequest, forced_scan, new_call_id


@dataclass(frozen=True)
class OutputParsing:
    """What a chat request's output goes through (None parts are skipped)."""

    tools: ToolRequest | None = None
    tool_parser: ToolCallParser | None = None  # for tool_choice auto
    reasoning: ReasoningParser | None = None


@dataclass(frozen=True)
class Parts:
    reasoning: str
    content: str
    calls: tuple[ToolCall, ...]


class ChatOutput:
    def __init__(self, parsing: OutputParsing):
        self.parsing = parsing
        self.text = ""
        self._ids: list[str] = []  # call ids by index, fixed when a call is first sent
        self._sent = Parts("", "", ())
        self._memo: dict = {}  # where the tool-call scans of this growing text got to

    def parts(self, text: str, final: bool, memo: dict | None = None) -> Parts:
        """The text's parts; `memo` (streaming only) lets a scan read on from where the last one got."""
        reasoning, rest = "", text
        if self.parsing.reasoning is not None:
            split = self.parsing.reasoning.scan(text, final)
            reasoning, rest = split.reasoning, split.content
        tools = self.parsing.tools
        if tools is None or tools.choice == "none":
            return Parts(reasoning, rest, ())
        if tools.choice == "named":
            assert tools.name is not None
            calls = (ToolCall(tools.name, rest.lstrip()),) if rest.strip() else ()
            return Parts(reasoning, "", calls)
        if tools.choice == "required":
            return Parts(reasoning, "", forced_scan(rest, final, memo))
        if self.parsing.tool_parser is None:
            return Parts(reasoning, rest, ())
        scan = self.parsing.tool_parser.scan(rest, final, memo)
        return Parts(reasoning, scan.content, scan.calls)

    def delta(self, text: str, final: bool) -> dict:
        """The delta for `text` (this step's) and whether the choice ended; {} when nothing is settled."""
        self.text += text
        now = self.parts(self.text, final, self._memo)
        sent, delta = self._sent, dict[str, object]()
        if len(now.reasoning) > len(sent.reasoning):
            delta["reasoning_content"] = now.reasoning[len(sent.reasoning) :]
        if len(now.content) > len(sent.content):
            delta["content"] = now.content[len(sent.content) :]
        calls = []
        for index, call in enumerate(now.calls):
            if index >= len(sent.calls):
                call_json = self._with_id(index, call).to_json()
                calls.append({"index": index, **call_json})
            elif len(call.arguments) > len(sent.calls[index].arguments):
                fragment = call.arguments[len(sent.calls[index].arguments) :]
                calls.append({"index": index, "function": {"arguments": fragment}})
        if calls:
            delta["tool_calls"] = calls
        self._sent = Parts(
            max(now.reasoning, sent.reasoning, key=len),
            max(now.content, sent.content, key=len),
            now.calls if len(now.calls) >= len(sent.calls) else sent.calls,
        )
        return delta

    def message(self, text: str) -> dict:
        """The whole response's message for the choice's whole text."""
        self.text = text
        now = self.parts(text, True)
        message: dict = {"role": "assistant", "content": now.content if now.content or not now.calls else None}
        if self.parsing.reasoning is not None:
            message["reasoning_content"] = now.reasoning or None
        if now.calls:
            message["tool_calls"] = [self._with_id(i, call).to_json() for i, call in enumerate(now.calls)]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: a choice that ended by itself with calls (auto or required) ends with "tool_calls"; a
        named choice's ends with "stop", as OpenAI's does."""
        tools = self.parsing.tools
        forced_or_parsed = tools is not None and tools.choice in ("auto", "required")
        if reason == "stop" and forced_or_parsed and self.parts(self.text, True).calls:
            return "tool_calls"
        return reason

    def _with_id(self, index: int, call: ToolCall) -> ToolCall:
        parser = self.parsing.tool_parser
        while len(self._ids) <= index:
            self._ids.append(parser.new_call_id() if parser is not None else new_call_id())
        return ToolCall(call.name, call.arguments, self._ids[index])
