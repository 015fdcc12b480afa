"""What an engine step reports: per-sequence updates, and a prefill-role sequence ready to hand off."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.sequence import FinishReason


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step did for one sequence: the tokens it produced and whether it finished."""

    seq_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    # A stop string ended the sequence: its output text ends after this many characters (engine/stop_checker.py
    # decided where; streaming fronts cut their text there instead of searching for the stop string again).
    text_end_chars: int | None = None


@dataclass(frozen=True)
class Handoff:
    """A prefill-role sequence ready to move: its computed KV lives in `block_ids`."""

    seq_id: str
    token_ids: tuple[int, ...]  # prompt + first sampled token
    num_computed_tokens: int  # tokens whose KV is in the blocks (the prompt)
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
