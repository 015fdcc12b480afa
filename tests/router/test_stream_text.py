"""Streamed text never shows a stop string, even when the token that completes it carries more
characters after it. The engine's stop checker decides where the text ends (the last chunk's
`text_end_chars`, checked against the engine in tests/router/test_generate.py); the router holds text
back while it streams so that nothing past that point was sent."""
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


def _stream(tokenizer, stop: str, chunks) -> list[str]:
    request = RouterRequest("r", (1, 2), SamplingParams(max_tokens=10, stop=[stop]), 0, "", None, None, True, None)
    state = StreamState(request, tokenizer, 0.0, migration_limit=3)
    return [state.add(chunk)[0] for chunk in chunks]


def test_the_stop_string_is_cut_inside_the_final_token(tokenizer):
    token_id, text = _long_ascii_token(tokenizer)
    lead = tokenizer.encode("ab cd ", add_special_tokens=False)
    stop = text[1:3]  # completed by the final token, which goes on for more characters after it
    expected = tokenizer.decode(lead) + text[:1]  # where the engine's stop checker cuts
    chunks = [TokenChunk(tuple(lead), (), None), TokenChunk((token_id,), (), "stop", text_end_chars=len(expected))]
    assert "".join(_stream(tokenizer, stop, chunks)) == expected


def test_text_before_a_stop_string_spanning_chunks_is_shown_once(tokenizer):
    token_id, text = _long_ascii_token(tokenizer)
    lead = tokenizer.encode("hello there ", add_special_tokens=False)
    stop = tokenizer.decode(lead)[-2:] + text[:1]  # begins in the earlier chunk, completes in the last
    expected = tokenizer.decode(lead)[:-2]
    chunks = [TokenChunk(tuple(lead), (), None), TokenChunk((token_id,), (), "stop", text_end_chars=len(expected))]
    first, last = _stream(tokenizer, stop, chunks)
    assert len(first) <= len(expected) and first + last == expected  # the stop string's start was held back


def test_a_request_that_did_not_stop_on_a_string_gets_all_its_text(tokenizer):
    token_id, text = _long_ascii_token(tokenizer)
    lead = tokenizer.encode("ab cd ", add_special_tokens=False)
    chunks = [TokenChunk(tuple(lead), (), None), TokenChunk((token_id,), (), "length")]
    assert "".join(_stream(tokenizer, text[1:3], chunks)) == tokenizer.decode(lead) + text


def _state(tokenizer, params: SamplingParams) -> StreamState:
    return StreamState(RouterRequest("r", (1, 2), params, 0, "", None, None, True, None), tokenizer, 0.0, 3)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ended_a_request_is_not_rendered_unless_asked(tokenizer, include):
    """EOS or a stop token id: its id is streamed, its text shows only with include_stop_str_in_output
    (vLLM's rendering), even with skip_special_tokens false, where EOS would read as content."""
    token_id, text = _long_ascii_token(tokenizer)
    lead = tokenizer.encode("ab cd ", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert eos is not None and tokenizer.decode([eos]) != ""
    for stop_token, params in (
        (eos, SamplingParams(max_tokens=10, skip_special_tokens=False, include_stop_str_in_output=include)),
        (token_id, SamplingParams(max_tokens=10, stop_token_ids=[token_id], include_stop_str_in_output=include)),
    ):
        state = _state(tokenizer, params)
        first, _ = state.add(TokenChunk(tuple(lead), (), None))
        last, _ = state.add(TokenChunk((token_id, stop_token) if stop_token == eos else (stop_token,), (), "stop"))
        shown = tokenizer.decode(lead) + (text if stop_token == eos else "")
        assert first + last == shown + (tokenizer.decode([stop_token]) if include else "")
        assert state.token_ids[-1] == stop_token
    # a request cut by max_tokens shows every token
    state = _state(tokenizer, SamplingParams(max_tokens=10, skip_special_tokens=False))
    assert state.add(TokenChunk((token_id, eos), (), "length"))[0] == text + tokenizer.decode([eos])
