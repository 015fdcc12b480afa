"""The wire form of a `StepInput`: one flat int64 tensor, so a tensor-parallel driver can broadcast a
step to its other ranks over the TP process group (no pickle). `decode_step(encode_step(s))` equals `s`.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.model_runner import StepInput


def _ints(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


# Checked against the dataclass at import: a new StepInput field must get a place in `encode_step`
# and `decode_step`, or it would silently never reach the followers.
_STEP_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "num_decode_tokens",
    "decode_context_lens",
    "decode_block_tables",
    "prefill_query_lens",
    "prefill_context_lens",
    "prefill_block_tables",
    "logits_indices",
)
if tuple(f.name for f in dataclasses.fields(StepInput)) != _STEP_FIELDS:
    raise ImportError("StepInput's fields changed: update encode_step/decode_step in decode_worker/tp_group.py")


def encode_step(step: StepInput) -> torch.Tensor:
    """`step` as one int64 tensor: array count, each array's length, then the arrays below, flat.
    decode_block_tables travels with its shape, so an empty `[0]` table does not come back `[0, 0]`."""
    tables = step.decode_block_tables
    arrays = [
        step.input_ids,
        step.positions,
        step.slot_mapping,
        _ints([step.num_decode_tokens]),
        step.decode_context_lens,
        _ints(tables.shape),
        tables,
        _ints(step.prefill_query_lens),
        _ints(step.prefill_context_lens),
        *step.prefill_block_tables,
        step.logits_indices,
    ]
    if any(array.dtype != torch.int64 for array in arrays):
        raise TypeError("every StepInput tensor must be int64 to travel")
    flat = [array.reshape(-1) for array in arrays]
    return torch.cat([_ints([len(flat), *(array.numel() for array in flat)]), *flat])


def decode_step(message: torch.Tensor) -> StepInput:
    """The exact inverse of `encode_step`; refuses a message whose lengths do not add up."""
    message = message.cpu()
    count = int(message[0])
    lengths = message[1 : 1 + count].tolist()
    if count < 10 or 1 + count + sum(lengths) != message.numel():
        raise ValueError(f"malformed step message: {count} arrays, lengths {lengths}, {message.numel()} values")
    arrays = list(message[1 + count :].split(lengths))
    ids, positions, slots, num_decode, decode_lens, table_shape, tables, q_lens, ctx_lens = arrays[:9]
    prefill_tables, logits_indices = tuple(arrays[9:-1]), arrays[-1]
    if len(prefill_tables) != q_lens.numel():
        raise ValueError(f"malformed step message: {q_lens.numel()} prefills, {len(prefill_tables)} tables")
    return StepInput(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        num_decode_tokens=int(num_decode),
        decode_context_lens=decode_lens,
        decode_block_tables=tables.reshape(table_shape.tolist()),
        prefill_query_lens=tuple(q_lens.tolist()),
        prefill_context_lens=tuple(ctx_lens.tolist()),
        prefill_block_tables=prefill_tables,
        logits_indices=logits_indices,
    )


# ---- rank 0 --------------------------------------------------------------------------------------
