"""Turns a scheduled step into tensors and runs the model over the paged KV cache.

`build_step_input` is pure: it reads the scheduler's chunks and the block tables and returns a
`StepInput` of plain int64 tensors — the one message a tensor-parallel driver sends to its other ranks.
`ModelRunner.execute` runs the forward pass on any rank and returns logits for the sampling rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar, cast

import torch

from engine.attention import AttentionMetadata, PrefillSegment, PrefillTiles, build_prefill_tiles, prefill_rows_per_tile
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kernels import decode_attention_kernel
from engine.kv_storage import KVCacheStorage
from engine.model_loader import load_model
from engine.models.decoder import Attention
from engine.models.mla import set_absorbed_decode
from engine.parallel import SINGLE_RANK, TensorParallelGroup


@dataclass(frozen=True)
class StepInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decode_tokens: int  # the first rows are single-token chunks
    decode_context_lens: torch.Tensor  # [num_decode]
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks], padded with block 0
    prefill_query_lens: tuple[int, ...]
    prefill_context_lens: tuple[int, ...]
    prefill_block_tables: tuple[torch.Tensor, ...]
    logits_indices: torch.Tensor  # rows whose logits are sampled, in chunk order

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill_query_lens

    def to(self, device: torch.device) -> StepInput:
        """The same step with its tensors on `device` (itself when they are there already)."""
        if self.input_ids.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return replace(
            self,
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            decode_context_lens=move(self.decode_context_lens),
            decode_block_tables=move(self.decode_block_tables),
            prefill_block_tables=tuple(move(t) for t in self.prefill_block_tables),
            logits_indices=move(self.logits_indices),
        )


class _HasSeqId(Protocol):
    @property
    def seq_id(self) -> str: ...


class StepChunk(Protocol):
    """What `build_step_input` reads of a chunk: a `ScheduledChunk`, or a draft model's chunk."""

    @property
    def seq(self) -> _HasSeqId: ...
    @property
    def start(self) -> int: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def input_token_ids(self) -> Sequence[int]: ...
    @property
    def num_logits_rows(self) -> int: ...


ChunkT = TypeVar("ChunkT", bound=StepChunk)


def order_chunks(chunks: Sequence[ChunkT], decode_chunk_tokens: int = 1) -> list[ChunkT]:
    """Chunks of up to `decode_chunk_tokens` tokens first (the batched decode rows), then longer ones."""
    short = [c for c in chunks if c.num_new_tokens <= decode_chunk_tokens]
    return short + [c for c in chunks if c.num_new_tokens > decode_chunk_tokens]


def build_step_input(
    chunks: Sequence[StepChunk],
    block_table: Callable[[str], Sequence[int]],
    block_size: int,
    decode_chunk_tokens: int = 1,
) -> StepInput:
    """`chunks` must already be in `order_chunks(chunks, decode_chunk_tokens)` order. A chunk is
    anything with `seq`, `start`, `num_new_tokens`, `input_token_ids` and `num_logits_rows` (its last
    rows whose logits are returned, in order): a `ScheduledChunk`, or a draft model's chunk.

    A chunk of at most `decode_chunk_tokens` tokens becomes that many decode rows, row i attending to
    the cache up to its own position (its own KV is written before attention reads it), so a verify
    chunk (a token + its drafts, engine/speculative) runs through the decode kernels and CUDA graphs
    with no padding: rows are counted per token, not per longest chunk."""
    positions: list[int] = []
    slots: list[int] = []
    ids: list[int] = []
    logits_rows: list[int] = []
    decode_tables: list[Sequence[int]] = []  # one per decode chunk; its rows share it
    decode_rows: list[int] = []  # rows per decode chunk
    decode_lens: list[int] = []
    prefill_q, prefill_ctx, prefill_tables = [], [], []
    for chunk in chunks:
        table = block_table(chunk.seq.seq_id)
        end = chunk.start + chunk.num_new_tokens
        ids.extend(chunk.input_token_ids)
        positions.extend(range(chunk.start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(chunk.start, end))
        logits_rows.extend(range(len(ids) - chunk.num_logits_rows, len(ids)))
        num_blocks = (end + block_size - 1) // block_size
        if chunk.num_new_tokens <= decode_chunk_tokens:
            decode_tables.append(table[:num_blocks])
            decode_rows.append(chunk.num_new_tokens)
            decode_lens.extend(range(chunk.start + 1, end + 1))
        else:
            prefill_q.append(chunk.num_new_tokens)
            prefill_ctx.append(end)
            prefill_tables.append(torch.tensor(table[:num_blocks], dtype=torch.int64))
    return StepInput(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decode_lens),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int64),
        decode_block_tables=_pad_tables(decode_tables, decode_rows),
        prefill_query_lens=tuple(prefill_q),
        prefill_context_lens=tuple(prefill_ctx),
        prefill_block_tables=tuple(prefill_tables),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
    )


def _pad_tables(tables: list[Sequence[int]], rows: list[int]) -> torch.Tensor:
    """[sum(rows), widest table] int64, padded with block 0: table i repeated for its rows[i] rows."""
    width = max((len(t) for t in tables), default=0)
    padded = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    if len(rows) == sum(rows):
        return padded.view(len(tables), width)  # one row per chunk (plain decoding): no copy
    return padded.view(len(tables), width).repeat_interleave(torch.tensor(rows), dim=0)


def attention_metadata(
    step: StepInput, block_size: int, native_decode: bool = False, prefill_tiles: PrefillTiles | None = None
) -> AttentionMetadata:
    """`native_decode`: a kernel reads the paged cache in place (the C kernel on CPU, Triton on CUDA),
    so the padded slot tensors are not built; `prefill_tiles`: the Triton prefill kernel reads it in
    place too, so no chunk's context slots are built. Tensors are made on the step's device."""
    # Slots within a block; built only where a path reads slots (a native decode step reads none).
    offsets = None
    if (step.num_decode_tokens and not native_decode) or (prefill_tiles is None and step.prefill_query_lens):
        offsets = torch.arange(block_size, dtype=torch.int64, device=step.slot_mapping.device)
    decode_slots = padding = None
    if offsets is not None and step.num_decode_tokens and not native_decode:
        tables = step.decode_block_tables
        decode_slots = (tables[:, :, None] * block_size + offsets).reshape(tables.shape[0], -1)
        columns = torch.arange(decode_slots.shape[1], device=offsets.device)
        padding = columns[None, :] >= step.decode_context_lens[:, None]
    segments, start = [], step.num_decode_tokens
    for index, (q_len, ctx_len) in enumerate(zip(step.prefill_query_lens, step.prefill_context_lens, strict=True)):
        slots = None
        # Attends to earlier KV in the cache (a prefix hit or an earlier chunk), read here by slot.
        if ctx_len > q_len and prefill_tiles is None and offsets is not None:
            table = step.prefill_block_tables[index]
            slots = (table[:, None] * block_size + offsets).reshape(-1)[:ctx_len]
        segments.append(PrefillSegment(start, q_len, ctx_len, slots))
        start += q_len
    return AttentionMetadata(
        step.slot_mapping,
        step.num_decode_tokens,
        step.decode_block_tables,
        step.decode_context_lens,
        decode_slots,
        padding,
        tuple(segments),
        prefill_tiles,
    )


class ModelRunner:
    """Owns the model weights and this rank's KV cache storage, on the engine's device."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        model_cfg: ModelConfig,
        max_model_len: int,
        num_blocks: int,
        tp: TensorParallelGroup = SINGLE_RANK,
        progress: bool = False,
        max_decode_rows: int | None = None,
    ):
        """`max_decode_rows`: most decode rows one step has (default: max_num_seqs x the config's
        `decode_chunk_tokens`); CUDA graphs are captured up to it."""
        self.block_size = engine_cfg.block_size
        self.device = resolve_device(engine_cfg.device)
        self.model = load_model(engine_cfg, model_cfg, max_model_len, tp, progress).to(self.device)
        set_absorbed_decode(self.model, engine_cfg.mla_absorbed_decode)
        # cast: nn.ModuleList's items are typed as plain Modules.
        kv_heads = cast(Attention, self.model.model.layers[0].self_attn).num_kv_heads
        # MLA attends over its latent cache in PyTorch (engine/models/mla.py): no paged kernel, no graphs.
        paged_kernels = model_cfg.mla is None
        use_graphs = self.device.type == "cuda" and engine_cfg.cuda_graphs and paged_kernels
        # With graphs, one more block than the pool owns: the scratch block padding rows write to.
        self.kv_cache = KVCacheStorage(
            engine_cfg.kv_format(model_cfg),
            model_cfg.num_layers,
            kv_heads,
            num_blocks + use_graphs,
            self.block_size,
            model_cfg.head_dim,
            self.device,
            model_cfg.kv_planes,
        )
        # A kernel reads the paged cache in place: on CPU the C kernel (fp32 models; other dtypes take
        # the PyTorch path), on CUDA the Triton kernel (every dtype and KV format).
        # On CUDA the Triton prefill kernel takes unquantized caches (quantized ones keep the PyTorch path).
        self.prefill_rows_per_tile = 0
        if not paged_kernels:
            self.native_decode = False
        elif self.device.type == "cuda":
            self.native_decode = True
            if not self.kv_cache.fmt.quantized:
                self.prefill_rows_per_tile = prefill_rows_per_tile(model_cfg.torch_dtype)
        else:
            self.native_decode = model_cfg.torch_dtype == torch.float32 and decode_attention_kernel() is not None
        self.graphs = (
            DecodeGraphs(
                self._decode_logits,
                self.device,
                max_decode_rows or engine_cfg.max_num_seqs * engine_cfg.decode_chunk_tokens,
                max_model_len,
                self.block_size,
                scratch_block=num_blocks,
            )
            if use_graphs
            else None
        )
        if self.graphs is not None and tp.size == 1:
            # Up front, as serving engines do: no step later stalls on a capture. Tensor-parallel ranks
            # capture lazily, in the lockstep of their steps (a captured forward holds collectives).
            self.graphs.capture_all()

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Runs one step on this rank (all-reduces included); returns the final hidden states. TP
        followers stop here: only rank 0 samples, so only it needs logits."""
        tiles = None
        if self.prefill_rows_per_tile and step.prefill_query_lens:  # tiled from the host's tables: no sync
            tiles = build_prefill_tiles(
                step.num_decode_tokens,
                step.prefill_query_lens,
                step.prefill_context_lens,
                step.prefill_block_tables,
                self.prefill_rows_per_tile,
                self.device,
            )
            # The tiles carry the tables (one padded copy): the per-chunk ones need not reach the device.
            step = replace(step, prefill_block_tables=())
        step = step.to(self.device)
        meta = attention_metadata(step, self.block_size, self.native_decode, tiles)
        return self.model(step.input_ids, step.positions, self.kv_cache, meta)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Runs one step; returns fp32 logits `[len(step.logits_indices), vocab]` on the device."""
        graphs = self.graphs
        if (
            graphs is not None
            and step.is_decode_only
            and graphs.can_run(step.num_decode_tokens, step.decode_block_tables.shape[1])
        ):
            logits = graphs.run(
                step.input_ids, step.positions, step.slot_mapping, step.decode_context_lens, step.decode_block_tables
            )
            if torch.equal(step.logits_indices, torch.arange(logits.shape[0])):
                return logits  # every row samples (the usual decode step): no gather
            return logits[step.logits_indices.to(self.device)]
        return self.model.compute_logits(self.forward(step)[step.logits_indices.to(self.device)])

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """What a captured decode graph runs: the forward pass and the logits of every row."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta))


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig: device {name!r} needs CUDA, which this machine does not have")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
