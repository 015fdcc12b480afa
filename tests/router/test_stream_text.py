"""Streamed text never shows a stop string, even when the token that completes it carries more
characters after it (the engine stops on that token; the text must end before the stop string)."""
from __future__ import annotations

import pytest

from cluster.client import TokenChunk
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from router.stream_state import StreamState
from router.validation import RouterRequest
from tests.factories import TinySpec


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(str(checkpoint(TinySpec())))


def _long_ascii_token(tokenizer) -> tuple[int, str]:
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if len(text) >= 4 and text.isascii() and text.isalpha():
            return token_id, text
    raise AssertionError("no token of 4+ ASCII letters in the tiny vocabulary")


def _stream(tokenizer, stop: str, chunks) -> str:
    request = RouterRequest("r", (1, 2), SamplingParams(max_tokens=10, stop=[stop]), 0, "", None, None, True, None)
    state = StreamState(request, tokenizer, 0.0)
    return "".join(state.add(chunk)[0] for chunk in chunks)


def test_the_stop_string_is_cut_inside_the_final_token(tokenizer):
    token_id, text = _long_ascii_token(tokenizer)
    lead = tokenizer.encode("ab cd ", add_special_tokens=False)
    stop = text[1:3]  # completed by the final token, which goes on for more characters after it
    chunks = [TokenChunk(tuple(lead), (), None), TokenChunk((token_id,), (), "stop")]
    assert _stream(tokenizer, stop, chunks) == tokenizer.decode(lead) + text[:1]


def test_text_before_a_stop_string_spanning_chunks_is_shown_once(tokenizer):
    token_id, text = _long_ascii_token(tokenizer)
    lead = tokenizer.encode("hello there ", add_special_tokens=False)
    stop = tokenizer.decode(lead)[-2:] + text[:1]  # begins in the earlier chunk, completes in the last
    chunks = [TokenChunk(tuple(lead), (), None), TokenChunk((token_id,), (), "stop")]
    assert _stream(tokenizer, stop, chunks) == tokenizer.decode(lead)[:-2]
