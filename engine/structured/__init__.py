"""Structured outputs: constraining sampling to a JSON schema, a regex, a choice list or a grammar.

`spec.StructuredOutputSpec` is what a request carries (plain data, it crosses processes inside
`SamplingParams`); the grammar backend compiles it once (cached) and each sequence keeps a matcher
that masks the logits of every step and advances with every accepted token.
"""

from engine.structured.spec import STRUCTURED_KINDS, StructuredOutputSpec

__all__ = ["STRUCTURED_KINDS", "StructuredOutputSpec"]
