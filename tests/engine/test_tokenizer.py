"""Incremental detokenization: the streamed deltas add up to decoding every id at once."""
from __future__ import annotations

import random

import pytest

from engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from tests.factories import TinySpec

TEXT = "Streaming text with accents (é, ü), CJK 漢字 and an emoji 🚀, one token at a time."


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint(TinySpec()))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_join_to_the_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(3)
    streams = [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 80))] for _ in range(40)]
    streams.append(tokenizer.encode(TEXT, add_special_tokens=False))
    for ids in streams:
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        joined = "".join(detokenizer.append(t) for t in ids)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert joined == detokenizer.text
        # Only trailing bytes of incomplete characters (decoded as U+FFFD) may still be held back.
        assert full.startswith(joined) and set(full[len(joined):]) <= {"\ufffd"}, (ids, full, joined)


def test_multibyte_characters_are_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("漢", add_special_tokens=False)
    assert len(ids) > 1, "the byte-level tokenizer splits this character over several tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.append(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "漢"


def test_special_tokens_are_skipped_by_default(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("hello", add_special_tokens=False) + [eos]
    skipping, keeping = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer, False)
    for token_id in ids:
        skipping.append(token_id)
        keeping.append(token_id)
    assert skipping.text == "hello" and keeping.text == "hello" + tokenizer.eos_token
