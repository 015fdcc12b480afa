"""CPU-side logic of the CUDA path: how a decode step is packed for a captured graph (padding rows
write to and read from the scratch block only), which batch sizes get graphs, and how two transport
endpoints agree on a backend from their GPUs."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import graph_batch_sizes, pack_decode_rows, unpack
from kvtransfer.store import agree_backend


def test_pack_pads_rows_into_the_scratch_block():
    batch, width, block_size, scratch = 4, 5, 16, 99
    out = torch.full((batch * (4 + width),), -7, dtype=torch.int64)
    tables = torch.tensor([[3, 4, 0], [8, 9, 10]])
    pack_decode_rows(
        torch.tensor([11, 12]),
        torch.tensor([20, 40]),
        torch.tensor([52, 168]),
        torch.tensor([21, 41]),
        tables,
        out,
        batch,
        width,
        scratch,
        block_size,
    )
    fields, table = unpack(out, batch, width)
    assert fields.tolist() == [
        [11, 12, 0, 0],
        [20, 40, 0, 0],
        [52, 168, scratch * block_size, scratch * block_size],
        [21, 41, 1, 1],
    ]
    assert table.tolist() == [[3, 4, 0, scratch, scratch], [8, 9, 10, scratch, scratch]] + [[scratch] * width] * 2
    assert (out != -7).all()  # every element written


def test_graph_batch_sizes_end_at_max_num_seqs():
    assert graph_batch_sizes(64)[-1] == 64 and graph_batch_sizes(64)[:4] == (1, 2, 4, 8)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(1000)[-1] == 1000 and 256 in graph_batch_sizes(1000)
    assert graph_batch_sizes(5000)[-1] == 1536


@pytest.mark.parametrize(
    "mine,theirs,agreed",
    [
        ("cuda@GPU-a", "cuda@GPU-a", "cuda_ipc"),
        ("cuda@GPU-a", "cuda@GPU-b", "nccl"),
        ("gloo", "gloo", "gloo"),
        ("cuda_ipc", "cuda_ipc", "cuda_ipc"),
    ],
)
def test_backend_agreement_is_symmetric(mine, theirs, agreed):
    assert agree_backend(mine, theirs) == agree_backend(theirs, mine) == agreed


def test_backend_mismatch_names_both_sides():
    with pytest.raises(RuntimeError, match="this side uses gloo, the peer cuda@GPU-a"):
        agree_backend("gloo", "cuda@GPU-a")
