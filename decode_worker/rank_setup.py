"""Builds what one decode rank runs: its transport endpoint, its model shard and KV cache, and on
rank 0 the engine loop (scheduler + sampler) that drives the instance."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from common.config import ClusterConfig
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
    follower_alive: Callable[[], bool] = lambda: True  # ranks > 0: still following rank 0


def build_rank(owner, config: ClusterConfig, model_dir: str, store_host: str, store_port: int) -> RankSetup:
    """`owner` is the DecodeRank (its `peer_id`, `rank`, `group_id`, `outbox`, `on_kv_event`, and
    `follower_shards(runner)`: what a rank > 0 tells of its steps, or None)."""
    engine_cfg = config.engine_config("decode", model_dir)
    transport = TorchDistTransport(owner.peer_id, store_host, store_port)
    if config.decode.tp_size == 1:
        engine = LLMEngine(engine_cfg, on_kv_event=owner.on_kv_event)
        loop = EngineLoop(
            engine,
            lambda updates: owner.outbox.push_step(engine, updates),
            name=f"{owner.peer_id}-engine",
            on_step=owner.telemetry.on_step,
        ).start()

        def close() -> None:
            loop.stop()
            transport.close()

        return RankSetup(
            transport, engine.runner, engine.model_config, engine.num_blocks, engine.max_model_len, loop, close
        )
    return _build_tp_rank(owner, config, engine_cfg, transport, store_host, store_port)


def _build_tp_rank(owner, config: ClusterConfig, engine_cfg, transport, store_host, store_port) -> RankSetup:
    """Rank 0 drives the step loop and broadcasts each step; ranks > 0 follow on a thread."""
    from decode_worker.tp_group import StepFollower, TensorParallelEngine, build_follower_runner, create_tp_group

    tp = create_tp_group(
        owner.group_id, owner.rank, config.decode.tp_size, store_host, store_port, timeout_s=config.ready_timeout_s
    )
    if owner.rank == 0:
        engine = TensorParallelEngine(engine_cfg, tp, on_kv_event=owner.on_kv_event)
        loop = EngineLoop(
            engine,
            lambda updates: owner.outbox.push_step(engine, updates),
            name=f"{owner.peer_id}-engine",
            on_step=owner.telemetry.on_step,
        ).start()

        def close() -> None:
            loop.stop()
            engine.shutdown()
            transport.close()

        return RankSetup(
            transport, engine.runner, engine.model_config, engine.num_blocks, engine.max_model_len, loop, close
        )
    runner = build_follower_runner(engine_cfg, tp)
    stop = threading.Event()
    thread = threading.Thread(
        target=_follow,
        args=(StepFollower(tp), runner, stop, owner.peer_id, owner.follower_shards(runner)),
        daemon=True,
        name=f"{owner.peer_id}-follower",
    )
    thread.start()
    model_cfg = runner.model.config

    def close_follower() -> None:
        stop.set()
        transport.close()

    return RankSetup(
        transport,
        runner,
        model_cfg,
        runner.kv_cache.num_blocks,
        engine_cfg.max_len_for(model_cfg),
        None,
        close_follower,
        thread.is_alive,
    )


def _follow(follower, runner, stop: threading.Event, name: str, observer=None) -> None:
    try:
        follower.run(runner, stop, observer)
    except Exception as err:  # noqa: BLE001 - the instance is lost without its rank 0; say so in the worker's log
        logging.getLogger(__name__).error("%s stopped following rank 0: %s", name, err)
