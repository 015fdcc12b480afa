"""Decode steps on CUDA replayed from captured CUDA graphs: one launch per step instead of hundreds.

A decode step of a 1B model is ~500 kernel launches; eagerly that is ~1-2 ms of CPU time per step,
as long as the GPU work itself at batch 64 (README, performance). A graph per padded batch size
replays them all at once.

Shapes are fixed per graph: `batch` rows (the step's decode rows, then padding) and block tables as
wide as `max_model_len` needs. Everything a step changes lives in one device buffer (`_Inputs`)
refreshed by a single host-to-device copy from a pinned staging buffer. Padding rows write their
KV into a scratch block that no sequence owns (the storage's last block, outside the block pool)
and attend to that block alone, so they never touch real KV. `capture_all()` captures every size up
front, largest first, all in one memory pool (steps never overlap, so their graphs can share it); a
size not captured yet is captured the first time a step needs it (a one-off stall of that step).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata

# Padded row counts a graph is captured for (up to the engine's most decode rows: max_num_seqs, times
# 1 + k with speculation, whose verify chunks are decode rows too).
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536)
_FIELDS = 4  # input_ids, positions, slot_mapping, context_lens; then the block table


def graph_batch_sizes(max_rows: int) -> tuple[int, ...]:
    sizes = tuple(b for b in _BUCKETS if b < max_rows)
    return (*sizes, min(max_rows, _BUCKETS[-1]))


def unpack(buffer: torch.Tensor, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a flat step buffer: fields [4, batch] (ids, positions, slots, context lengths, each row
    contiguous, as the kernels read them) and the block table [batch, width]."""
    return buffer[: _FIELDS * batch].view(_FIELDS, batch), buffer[_FIELDS * batch :].view(batch, width)


def pack_decode_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    tables: torch.Tensor,
    out: torch.Tensor,
    batch: int,
    width: int,
    scratch_block: int,
    block_size: int,
) -> None:
    """Writes a decode step's rows into the flat int64 buffer `out` (see `unpack`), padding the rest:
    padding rows use token 0 at position 0, write to slot 0 of `scratch_block` and attend to it."""
    fields, table = unpack(out, batch, width)
    rows, step_width = tables.shape
    fields[0:2].zero_()
    fields[2].fill_(scratch_block * block_size)
    fields[3].fill_(1)
    table.fill_(scratch_block)
    for column, values in enumerate((input_ids, positions, slots, context_lens)):
        fields[column, :rows].copy_(values)
    table[:rows, :step_width].copy_(tables)


class _Graph:
    """One captured decode step for `batch` rows: its input buffer and output logits."""

    def __init__(
        self, batch: int, width: int, device: torch.device, run: Callable, scratch_block: int, block_size: int, pool
    ):
        self.batch, self.width = batch, width
        self.host = torch.empty(batch * (_FIELDS + width), dtype=torch.int64, pin_memory=True)
        nothing = torch.empty(0, dtype=torch.int64)
        pack_decode_rows(
            nothing, nothing, nothing, nothing, nothing.view(0, 0), self.host, batch, width, scratch_block, block_size
        )
        self.inputs = self.host.to(device)
        (ids, positions, slots, lens), tables = unpack(self.inputs, batch, width)
        meta = AttentionMetadata(slots, batch, tables, lens, None, None, ())
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: compiles kernels, creates handles
            run(ids, positions, meta)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = run(ids, positions, meta)


class DecodeGraphs:
    """Runs decode-only steps of up to `max_batch` sequences through captured graphs.

    `run(ids, positions, meta)` is the step's forward pass returning logits for every row. The
    logits it returns for a step stay valid until the next step (all graphs share one memory pool).
    """

    def __init__(
        self,
        run: Callable,
        device: torch.device,
        max_rows: int,
        max_model_len: int,
        block_size: int,
        scratch_block: int,
    ):
        self._run, self._device = run, device
        self.sizes = graph_batch_sizes(max_rows)
        self.width = -(-max_model_len // block_size)
        self.block_size, self.scratch_block = block_size, scratch_block
        self._graphs: dict[int, _Graph] = {}
        self.replays: Counter[int] = Counter()  # steps replayed per padded size (tests, diagnostics)
        self._pool: object | None = None  # the shared memory pool, once the first graph is captured

    def capture_all(self) -> None:
        """Captures every padded size now (largest first: the pool is sized by the first capture)."""
        for size in reversed(self.sizes):
            self._graph(size)

    def can_run(self, num_decode_rows: int, table_width: int) -> bool:
        """For a decode-only step of `num_decode_rows` rows whose block tables are `table_width` wide."""
        return 0 < num_decode_rows <= self.sizes[-1] and table_width <= self.width

    def padded_size(self, rows: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, rows)]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        tables: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step from host tensors (the step's own); returns logits [rows, vocab]."""
        rows = input_ids.shape[0]
        graph = self._graph(self.padded_size(rows))
        # The pinned buffer is rewritten only after the previous step's logits were read (a sync).
        pack_decode_rows(
            input_ids,
            positions,
            slots,
            context_lens,
            tables,
            graph.host,
            graph.batch,
            graph.width,
            self.scratch_block,
            self.block_size,
        )
        graph.inputs.copy_(graph.host, non_blocking=True)
        graph.graph.replay()
        self.replays[graph.batch] += 1
        return graph.logits[:rows]

    def _graph(self, batch: int) -> _Graph:
        if batch not in self._graphs:
            graph = _Graph(batch, self.width, self._device, self._run, self.scratch_block, self.block_size, self._pool)
            self._graphs[batch], self._pool = graph, graph.graph.pool()
        return self._graphs[batch]
