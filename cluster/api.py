"""A synchronous handle on a running cluster, for scripts and notebooks:

    with Cluster(ClusterConfig()) as cluster:
        for chunk in cluster.generate([1, 2, 3], SamplingParams(max_tokens=8)):
            print(chunk.token_ids)

It owns an event loop on a background thread where the asyncio `ClusterClient` runs; asyncio code
(the router) uses `ClusterClient` directly instead.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Self

from cluster.client import ClusterClient, TokenChunk
from cluster.launcher import LaunchedCluster, launch
from common.config import ClusterConfig
from common.messages import GenerateRequest
from engine.sampling_params import SamplingParams

_END = object()


class Cluster:
    def __init__(self, config: ClusterConfig | None = None, model_dir: str | None = None):
        self.config = config or ClusterConfig()
        self.launched: LaunchedCluster = launch(self.config, model_dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster-client", daemon=True)
        self._thread.start()
        self.client = ClusterClient(self.launched)
        self._ids = itertools.count()

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "",
    ) -> Iterator[TokenChunk]:
        """Streams the request's tokens; raises RequestFailed (with the reason) if it fails."""
        request = GenerateRequest(
            request_id or f"sync-{next(self._ids)}",
            tuple(prompt_token_ids),
            params or SamplingParams(),
            priority,
            tenant,
        )
        chunks: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for chunk in self.client.generate(request):
                    chunks.put(chunk)
                chunks.put(_END)
            except BaseException as err:  # noqa: BLE001 - delivered to the caller's thread below
                chunks.put(err)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = chunks.get(timeout=self.config.request_timeout_s + 10.0)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def generate_tokens(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None, **kwargs
    ) -> list[int]:
        return [token for chunk in self.generate(prompt_token_ids, params, **kwargs) for token in chunk.token_ids]

    def shutdown(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.launched.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
