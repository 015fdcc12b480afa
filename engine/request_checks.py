"""Validation of a new request against the model and the KV pool; every error names its field."""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


def check_new_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    priority: int,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> list[int]:
    """Returns the prompt as a fresh list of ints, or raises InvalidRequestError."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("priority", "must be an integer")
    tokens = list(prompt_token_ids)
    if not tokens:
        raise InvalidRequestError("prompt", "is empty; at least one token is required")
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                "prompt_token_ids", f"token {token!r} at index {index} is outside the vocabulary [0, {vocab_size})"
            )
    if len(tokens) >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"has {len(tokens)} tokens; the model's limit is {max_model_len} tokens including at least one generated",
        )
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidRequestError("stop_token_ids", f"{bad_stop} outside the vocabulary [0, {vocab_size})")
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad_bias:
        raise InvalidRequestError("logit_bias", f"token ids {bad_bias[:5]} outside the vocabulary [0, {vocab_size})")
    blocks_needed = (len(tokens) + 1 + block_size - 1) // block_size
    if blocks_needed > num_blocks:
        raise InvalidRequestError("prompt", f"needs {blocks_needed} KV blocks; this worker's pool has {num_blocks}")
    return tokens


def check_resumed_outputs(
    output_token_ids: Sequence[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """Tokens a resumed request already generated: in the vocabulary, leaving room for one more."""
    for index, token in enumerate(output_token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                "output_token_ids", f"token {token!r} at index {index} is outside the vocabulary [0, {vocab_size})"
            )
    count = len(output_token_ids)
    if count >= params.max_tokens:
        raise InvalidRequestError("output_token_ids", f"{count} tokens already reach max_tokens={params.max_tokens}")
    total = num_prompt_tokens + count
    if total >= max_model_len:
        raise InvalidRequestError(
            "output_token_ids",
            f"prompt and output hold {total} tokens; the model's limit is {max_model_len} including the next one",
        )
    if (total + 1 + block_size - 1) // block_size > num_blocks:
        raise InvalidRequestError(
            "output_token_ids", f"prompt and output need more KV blocks than this worker's pool of {num_blocks}"
        )
