"""Reasoning parsers: a thinking model's text → (`reasoning_content`, `content`), as vLLM splits them.

- `deepseek_r1`: `reasoning</think>answer` (the template opened `<think>` in the prompt; a leading
  `<think>` is dropped too). Reasoning is everything before `</think>`, all of it while none has come.
- `qwen3`: `<think>reasoning</think>answer`, or a plain answer (`enable_thinking: false`). Reasoning is
  between the tags; a text that does not open with `<think>` is all content.

`scan(text, final)` returns what is settled so far; both parts only grow as the text grows (a tag cut at
the end is held back until the next token decides it), which is what streaming relies on. Parsers live
in `REASONING_PARSERS`; the names are `common.router_config.REASONING_PARSERS`.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


class ReasoningParser:
    def scan(self, text: str, final: bool) -> Split:
        raise NotImplementedError


class DeepSeekR1Parser(ReasoningParser):
    def scan(self, text: str, final: bool) -> Split:
        body = _after_start(text, final)
        if body is None:
            return Split("", "")
        return _until_end(body, final)


class Qwen3Parser(ReasoningParser):
    def scan(self, text: str, final: bool) -> Split:
        stripped = text.lstrip()
        if not stripped.startswith(START):
            if not final and START.startswith(stripped):  # may still open with <think>
                return Split("", "")
            return Split("", text)
        return _until_end(stripped[len(START) :], final)


def _after_start(text: str, final: bool) -> str | None:
    """The text after a leading `<think>`, or all of it; None while a cut tag could still be `<think>`."""
    stripped = text.lstrip()
    if stripped.startswith(START):
        return stripped[len(START) :]
    if not final and stripped and START.startswith(stripped):
        return None
    return text


def _until_end(body: str, final: bool) -> Split:
    end = body.find(END)
    if end >= 0:
        return Split(body[:end], body[end + len(END) :])
    if final:  # thinking cut short (max_tokens): all of it is reasoning
        return Split(body, "")
    return Split(_hold_back(body, END), "")


def _hold_back(text: str, marker: str) -> str:
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:keep]):
            return text[:-keep]
    return text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}
