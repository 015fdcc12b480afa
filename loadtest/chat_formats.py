"""What the `openai-chat` bench backend asks of each answer (`--chat-format`), beside the messages.

- `plain`: free text, `ignore_eos` (every request generates its planned length, as the other backends).
- `tools`: two function tools with `tool_choice: "required"`: the answer is held to a tool-call grammar
  (structured outputs), so the grammar's per-token mask cost shows in TPOT.
- `json-schema`: `response_format` with a nested JSON schema (objects, an array, enums), strict.

A format held to a grammar ends when the grammar does (EOS is then the only token allowed), so it is sent
without `ignore_eos`: planned lengths become upper bounds, and the summary's token counts are what was
generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
_SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 48}, "top_k": {"enum": [1, 3, 5]}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}, "tier": {"enum": ["free", "pro"]}},
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12}, "quantity": {"enum": [1, 2, 3]}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "express"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class ChatFormat:
    extras: dict = field(default_factory=dict)  # body fields added to every request
    ignore_eos: bool = True  # False where a grammar decides the end


CHAT_FORMATS: dict[str, ChatFormat] = {
    "plain": ChatFormat(),
    "tools": ChatFormat({"tools": [_WEATHER, _SEARCH], "tool_choice": "required"}, ignore_eos=False),
    "json-schema": ChatFormat(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "order", "strict": True, "schema": ORDER}}},
        ignore_eos=False,
    ),
}
