"""One simulated prefill worker of `benchmarks.prefill_sim`: a real KV cache manager, modelled compute."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from common.kv_events import KVEventBuffer
from engine.kv_cache_manager import KVCacheManager
from policies.routing import WorkerLoad

if TYPE_CHECKING:
    from benchmarks.prefill_sim import SimConfig, SimRequest


class SimWorker:
    """One prefill worker: a real KV cache manager whose events fill a real buffer; compute is modelled."""

    def __init__(self, worker_id: str, config: SimConfig):
        self.worker_id = worker_id
        self.events = KVEventBuffer(worker_id, epoch=1)  # a fixed epoch keeps replays deterministic
        self.kv = KVCacheManager(config.blocks_per_worker, config.block_size, on_event=self.events.append)
        self.waiting: deque[tuple[SimRequest, int, float]] = deque()  # (request, router's uncached estimate,
        #                                                              seconds its prefix pull takes)
        self.block_size = config.block_size
        self.running: tuple[SimRequest, int, list[int]] | None = None
        self.queued_prompt_tokens = 0  # the router's view: estimates of routed, not yet prefilled prompts
        self.computed_tokens = 0

    def load(self) -> WorkerLoad:
        running = 1 if self.running is not None else 0
        return WorkerLoad(self.worker_id, len(self.waiting) + running, self.queued_prompt_tokens)

    def enqueue(self, request: SimRequest, estimate_tokens: int, pull_s: float = 0.0) -> None:
        self.waiting.append((request, estimate_tokens, pull_s))
        self.queued_prompt_tokens += estimate_tokens

    def pull_from(self, holder: SimWorker, request: SimRequest, num_blocks: int) -> int:
        """A prefix pull (prefill_worker/prefix_pull.py) at arrival: copies the leading blocks the holder
        still holds beyond the local ones into this pool, cached and pinned until the request starts.
        Returns the blocks pulled (0: nothing to pull or no room)."""
        tokens, hashes = request.token_ids.tolist(), request.block_hashes[:num_blocks]
        local = self.kv.find_cached_prefix(tokens, hashes)
        held = len(holder.kv.find_cached_prefix(tokens, hashes).block_ids)
        pin = f"{request.request_id}#pull"
        if held <= len(local.block_ids) or not self.kv.can_allocate(pin, held * self.block_size, local):
            return 0
        self.kv.allocate(pin, held * self.block_size, local)
        self.kv.cache_blocks(pin, tokens, request.block_hashes, held * self.block_size)
        return held - len(local.block_ids)

    def start_next(self) -> tuple[SimRequest, int, float]:
        """Schedules the oldest waiting request as the engine would; returns it, its cached tokens and
        the seconds its prefix pull took."""
        request, estimate_tokens, pull_s = self.waiting.popleft()
        tokens = request.token_ids.tolist()
        cached = self.kv.find_cached_prefix(tokens, request.block_hashes)
        if not self.kv.can_allocate(request.request_id, len(tokens), cached):
            # One prefill at a time and no pinned blocks: only a pool smaller than one prompt gets here.
            raise RuntimeError(f"{self.worker_id}: {self.kv.num_blocks} blocks cannot hold {request.request_id}")
        self.kv.allocate(request.request_id, len(tokens), cached)
        self.kv.free(f"{request.request_id}#pull")  # the request holds its pulled prefix itself now
        self.running = (request, estimate_tokens, tokens)
        self.computed_tokens += len(tokens) - cached.num_tokens
        return request, cached.num_tokens, pull_s

    def finish(self) -> None:
        """The prefill is done: cache its full blocks (BlockStored events), then release them."""
        assert self.running is not None, "finish() follows start()"
        request, estimate_tokens, tokens = self.running
        self.kv.cache_blocks(request.request_id, tokens, request.block_hashes, len(tokens))
        self.kv.free(request.request_id)
        self.queued_prompt_tokens -= estimate_tokens
        self.running = None
