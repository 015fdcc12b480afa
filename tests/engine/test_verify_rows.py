"""A verify chunk (a token and its drafts) laid out as decode rows: row i attends to the cache up to its
own position. The layout is exact (the rows' logits equal the same chunk run as a prefill segment over
the cached prefix) for every attention path a decode row can take."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.config import EngineConfig
from engine.model_loader import load_engine_model_config
from engine.model_runner import ModelRunner, build_step_input, order_chunks
from tests.factories import TinySpec

BLOCK = 4
TABLE = [5, 2, 7, 0, 3, 6]  # deliberately out of order: rows must follow the table, not positions


@dataclass(frozen=True)
class _Seq:
    seq_id: str = "s"


@dataclass(frozen=True)
class _Chunk:
    start: int
    input_token_ids: list[int]
    num_logits_rows: int
    seq: _Seq = _Seq()

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)


def test_a_verify_chunk_becomes_one_decode_row_per_token():
    verify, plain = _Chunk(9, [11, 12, 13, 14], 4), _Chunk(6, [20], 1, _Seq("p"))
    chunks = order_chunks([verify, plain], decode_chunk_tokens=5)
    step = build_step_input(chunks, lambda _: TABLE, BLOCK, decode_chunk_tokens=5)
    assert step.is_decode_only and step.num_decode_tokens == 5
    assert step.decode_context_lens.tolist() == [10, 11, 12, 13, 7]
    assert step.positions.tolist() == [9, 10, 11, 12, 6]
    # position p lives in TABLE[p // BLOCK]: 9-11 in block 7, 12 in block 0, the plain row's 6 in block 2
    assert step.slot_mapping.tolist() == [7 * BLOCK + 1, 7 * BLOCK + 2, 7 * BLOCK + 3, 0 * BLOCK + 0, 2 * BLOCK + 2]
    assert step.decode_block_tables[:4].tolist() == [TABLE[:4]] * 4  # 13 tokens span 4 blocks
    assert step.decode_block_tables[4].tolist() == TABLE[:2] + [0, 0]
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4]
    # Without speculation's allowance the same chunk is a prefill segment after the decode row.
    step = build_step_input(order_chunks([verify, plain]), lambda _: TABLE, BLOCK)
    assert step.num_decode_tokens == 1 and step.prefill_query_lens == (4,)
    assert step.prefill_context_lens == (13,)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_decode_rows_equal_a_prefill_segment_over_the_cache(checkpoint, kv_cache_dtype, attention):
    model_dir = checkpoint(TinySpec(arch="llama", num_heads=4, num_kv_heads=2))
    config = EngineConfig(model_dir=str(model_dir), block_size=BLOCK, num_kv_blocks=8, kv_cache_dtype=kv_cache_dtype)
    model = load_engine_model_config(config)
    runner = ModelRunner(config, model, 32, 8)
    if attention == "torch":
        runner.native_decode = False
    elif not runner.native_decode:
        pytest.skip("the C decode kernel could not be built here")  # pragma: no cover
    tokens = torch.randint(0, model.vocab_size, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    prefix, verify = _Chunk(0, tokens[:9], 1), _Chunk(9, tokens[9:], 4)
    runner.execute(build_step_input([prefix], lambda _: TABLE, BLOCK))
    as_rows = runner.execute(build_step_input([verify], lambda _: TABLE, BLOCK, decode_chunk_tokens=5))
    as_segment = runner.execute(build_step_input([verify], lambda _: TABLE, BLOCK))
    assert as_rows.shape == as_segment.shape == (4, model.vocab_size)
    torch.testing.assert_close(as_rows, as_segment, atol=1e-5, rtol=1e-5)
