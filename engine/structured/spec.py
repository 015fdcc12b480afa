"""What a request asks its output to match: the plain-data half of structured outputs.

One kind per request, as vLLM's `structured_outputs` takes them:

| kind | value | from the OpenAI front |
|---|---|---|
| `json` | a JSON schema, as compact JSON text | `response_format: json_schema`, `structured_outputs.json`, tools |
| `json_object` | "" (any JSON object) | `response_format: json_object` |
| `regex` | a regular expression | `structured_outputs.regex` |
| `choice` | "" (the choices are in `choices`) | `structured_outputs.choice` |
| `grammar` | an EBNF grammar (GBNF style) | `structured_outputs.grammar` |

The spec is frozen and hashable, so compiled grammars can be cached by it. Whether the backend can
compile it is checked where it is compiled; errors then name `field`, the request field it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: str  # one of STRUCTURED_KINDS
    value: str = ""  # schema JSON text / regex / grammar; "" for json_object and choice
    choices: tuple[str, ...] = ()  # kind == "choice" only
    # The request field this came from, for errors ("response_format.json_schema.schema", ...).
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            known = list(STRUCTURED_KINDS)
            raise InvalidRequestError(self.field, f"unknown structured output kind {self.kind!r}; known: {known}")
        if not isinstance(self.value, str):
            raise InvalidRequestError(self.field, "must be a string")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidRequestError(self.field, "choice needs a non-empty list of non-empty strings")
        elif self.choices:
            raise InvalidRequestError(self.field, "choices are for kind 'choice' only")
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(self.field, f"a {self.kind} must be a non-empty string")

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "structured_outputs.json") -> StructuredOutputSpec:
        """A JSON schema given as parsed JSON, kept as compact text (equal schemas share a cache entry).
        Key order is kept: the grammar emits properties in the order the schema declares them."""
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(field, "must be a JSON schema (an object)")
        return cls("json", json.dumps(schema, separators=(",", ":")), field=field)
