"""The grammar backend contract (engine/structured/backend.py), run against every registered backend."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.structured.backend import bitmask_words
from engine.structured.registry import BACKENDS, grammar_backend
from engine.structured.spec import StructuredOutputSpec
from engine.tokenizer import load_tokenizer
from tests.factories import TinySpec


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, checkpoint):
    model_dir = checkpoint(TinySpec())
    tokenizer = load_tokenizer(model_dir)
    # A vocabulary wider than the tokenizer, as a padded LM head is: padding ids are never allowed.
    vocab_size = len(tokenizer) + 40
    return grammar_backend(
        f"contract:{model_dir}", lambda: tokenizer, vocab_size, (tokenizer.eos_token_id,), request.param
    ), tokenizer


def _allowed(matcher, vocab_size: int) -> set[int]:
    words = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(words)
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
    return set(bits.nonzero().flatten().tolist())


def test_compiled_grammars_are_cached_by_spec(backend):
    backend, _ = backend
    first = backend.compile(
        StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    again = backend.compile(
        StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    other = backend.compile(StructuredOutputSpec("regex", "[0-9]+"))
    assert first is again and other is not first


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputSpec.json_schema(
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            field="response_format.json_schema.schema",
        ),
        StructuredOutputSpec("regex", "(?<=a)b", field="structured_outputs.regex"),
        StructuredOutputSpec("grammar", "root ::= undefined_rule", field="structured_outputs.grammar"),
    ],
)
def test_a_spec_that_cannot_compile_names_its_field_in_one_line(backend, spec):
    backend, _ = backend
    with pytest.raises(InvalidRequestError) as error:
        backend.compile(spec)
    assert error.value.field == spec.field
    assert "\n" not in str(error.value) and "cannot be compiled" in str(error.value)


def test_matcher_masks_accepts_rolls_back_and_terminates(backend):
    backend, tokenizer = backend
    eos = tokenizer.eos_token_id
    matcher = backend.compile(StructuredOutputSpec("choice", choices=("yes", "no"))).matcher()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    start = _allowed(matcher, backend.vocab_size)
    assert yes[0] in start and eos not in start
    assert max(start) < len(tokenizer)  # padding ids past the tokenizer are never allowed
    forbidden = next(t for t in range(len(tokenizer)) if t not in start)
    assert not matcher.accept(forbidden)
    assert _allowed(matcher, backend.vocab_size) == start  # a refused token changes nothing
    for token in yes:
        assert matcher.accept(token)
    assert _allowed(matcher, backend.vocab_size) == {eos}  # complete: only the stop token
    assert not matcher.is_terminated
    matcher.rollback(len(yes))
    assert _allowed(matcher, backend.vocab_size) == start
    for token in yes:
        assert matcher.accept(token)
    assert matcher.accept(eos) and matcher.is_terminated


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level token of one byte (GPT-2's printable-byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = sorted(set(range(256)) - set(printable))
    char = chr(byte) if byte in printable else chr(256 + extra.index(byte))
    return tokenizer.convert_tokens_to_ids(char)


@pytest.mark.parametrize("bounded", [True, False])
def test_json_strings_hold_no_raw_control_character_and_no_surrogate(backend, bounded):
    """What Python's json and pydantic refuse: U+0000-U+001F unescaped, and UTF-16 surrogates (ED A0-BF)."""
    backend, tokenizer = backend
    string = {"type": "string", "maxLength": 4} if bounded else {"type": "string"}
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"], "additionalProperties": False}
    matcher = backend.compile(StructuredOutputSpec.json_schema(schema)).matcher()
    for token in tokenizer.encode('{"s": "', add_special_tokens=False):
        assert matcher.accept(token)
    allowed = _allowed(matcher, backend.vocab_size)
    assert _byte_token(tokenizer, ord("a")) in allowed
    assert not {_byte_token(tokenizer, b) for b in (0x01, 0x1F)} & allowed
    assert matcher.accept(_byte_token(tokenizer, 0xED))  # a valid lead byte (U+D000-U+D7FF follow it)
    after = _allowed(matcher, backend.vocab_size)
    assert _byte_token(tokenizer, 0x9F) in after and _byte_token(tokenizer, 0xA0) not in after
