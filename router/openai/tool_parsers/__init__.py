"""The tool-call parsers `tool_choice: "auto"` runs on a model's text, by the names vLLM gives them
(`--tool-call-parser`). `base` states the contract; `router.openai.tools.tool_call_parser` builds one."""

from __future__ import annotations

from router.openai.tool_parsers.base import Scan, ToolCall, ToolCallParser
from router.openai.tool_parsers.granite import GraniteParser
from router.openai.tool_parsers.hermes import HermesParser
from router.openai.tool_parsers.llama3_json import Llama3JsonParser
from router.openai.tool_parsers.mistral import MistralParser
from router.openai.tool_parsers.pythonic import PythonicParser
from router.openai.tool_parsers.qwen3_coder import Qwen3CoderParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
    "granite": GraniteParser,
}

__all__ = [
    "TOOL_CALL_PARSERS",
    "GraniteParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Qwen3CoderParser",
    "Scan",
    "ToolCall",
    "ToolCallParser",
]
