"""Builds what one decode rank runs: its transport endpoint, its model shard and KV cache, and on
rank 0 the engine loop (scheduler + sampler) that drives the instance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cluster.config import ClusterConfig
from engine.config import ModelConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from kvtransfer.torch_dist import TorchDistTransport


@dataclass
class RankSetup:
    transport: TorchDistTransport
    runner: ModelRunner
    model_config: ModelConfig
    num_blocks: int
    max_model_len: int
    loop: EngineLoop | None  # rank 0 only
    close: Callable[[], None]


def build_rank(owner, config: ClusterConfig, model_dir: str, store_host: str, store_port: int) -> RankSetup:
    """`owner` is the DecodeRank (its `peer_id`, `rank`, `instance_id`, `outbox`)."""
    engine_cfg = config.engine_config("decode", model_dir)
    transport = TorchDistTransport(owner.peer_id, store_host, store_port)
    if config.decode.tp_size == 1:
        engine = LLMEngine(engine_cfg)
        loop = EngineLoop(engine, lambda updates: owner.outbox.push_step(engine, updates),
                          name=f"{owner.peer_id}-engine").start()

        def close() -> None:
            loop.stop()
            transport.close()

        return RankSetup(transport, engine.runner, engine.model_config, engine.num_blocks, engine.max_model_len,
                         loop, close)
    return _build_tp_rank(owner, config, engine_cfg, transport, store_host, store_port)


def _build_tp_rank(owner, config, engine_cfg, transport, store_host, store_port) -> RankSetup:
    raise NotImplementedError("tensor-parallel decode ranks are wired in decode_worker/tp_group.py")
