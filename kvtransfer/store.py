"""Rendezvous store for KV transport channels: how two workers meet, generation after generation.

One ``TCPStore`` per cluster (hosted by the launcher) is the only shared state of the transport.
Each pair of workers (a, b) with a < b owns the keys under ``kvpair/<a>/<b>/`` (ids quoted so that a
``/`` inside an id cannot make two pairs collide):

- ``gen``               the pair's current generation, an integer counter (starts at 0).
- ``g<N>/claim/<rank>`` how many times rank ``<rank>`` has joined generation N (1 = fresh).
- ``g<N>/hello/<rank>`` the backend rank ``<rank>`` builds generation N with (handshake).
- ``g<N>/failed``       set (to a human-readable reason) when generation N broke by a failure.
- ``g<N>/pg/...``       the process group rendezvous of generation N (written by gloo / nccl).

Generation protocol (both sides run it independently; the store is the only arbiter):

1. **Join.** Read ``gen`` = N and ``add(g<N>/claim/<rank>, 1)``. A result of 1 means N is fresh for
   us: write ``g<N>/hello/<rank>``, wait (bounded) for the peer's hello, check both chose the same
   backend, and build the group under ``g<N>/pg``. A result above 1 means an earlier incarnation of
   this worker already joined N (it crashed without advancing): N is burnt, so mark it failed
   ("restarted") and advance, then retry. A join that times out marks N failed too.
2. **Advance.** Whoever stops using generation N (failure, close, eviction) does
   ``compare_set(gen, N, N+1)``: only the first side to give up on N moves the counter, so two
   sides detecting the same failure advance it once, and a side still holding an older generation
   can never push the counter past a generation the other side already joined.
3. **Failure.** On a failure the detecting side writes ``g<N>/failed`` *before* advancing and only
   then closes its sockets, so a side that finds its channel of generation N closed (or, for NCCL,
   reads ``gen > N`` before a call) also finds why N ended. It then raises the failure once (it
   must not silently resync into the next generation: the message it was waiting for is gone) and
   joins the newest generation on its next call. A clean close only advances: the other side
   follows silently, even out of a call it had pending.

Each generation leaves a few small keys in the store; generations only advance on failures,
closes and evictions, so the store grows by about a kilobyte per channel re-creation.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import quote

from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

DEFAULT_STORE_TIMEOUT_S = 30.0
HANDSHAKE_POLL_S = 0.05  # longest pause of a handshake polling for its peer's hello (and whether it left)


class RendezvousStore(NamedTuple):
    """The launcher's store and the address workers connect to."""

    store: TCPStore
    host: str
    port: int


def create_rendezvous_store(host: str = "127.0.0.1") -> RendezvousStore:
    """Host the cluster's rendezvous store on ``host`` with a port chosen by the OS.

    Keep the returned store object alive for as long as any worker uses the transport.
    ``wait_for_workers=False``: without it the master blocks until ``world_size`` clients joined,
    and workers of this store come and go.
    """
    store = TCPStore(host, 0, world_size=1, is_master=True, wait_for_workers=False)
    return RendezvousStore(store=store, host=host, port=store.port)


def connect_store(host: str, port: int, timeout_s: float = DEFAULT_STORE_TIMEOUT_S) -> TCPStore:
    """Connect to the rendezvous store as a client; ``timeout_s`` bounds connecting and blocking gets."""
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class PairRendezvous:
    """The generation protocol (module docstring) for one pair of workers, seen from one side.

    Stateless apart from the ids: every method is one or two store round trips (~0.1 ms on
    loopback), safe to call from any thread.
    """

    def __init__(self, store: Store, local_id: str, peer_id: str) -> None:
        if not local_id or not peer_id or local_id == peer_id:
            raise ValueError(f"a pair needs two different non-empty ids, got {local_id!r}, {peer_id!r}")
        low, high = sorted((local_id, peer_id))
        self.rank = 0 if local_id == low else 1
        self._local_id = local_id
        self._root = f"kvpair/{quote(low, safe='')}/{quote(high, safe='')}"
        self._store = store

    def current_generation(self) -> int:
        """The pair's newest generation (``add(…, 0)``: atomic read that never blocks on a missing key)."""
        return int(self._store.add(f"{self._root}/gen", 0))

    def join(self) -> int:
        """Claim the newest generation this side has never joined (step 1), skipping burnt ones.

        Terminates: each pass retires the generation it read, so the next read is strictly newer,
        and earlier incarnations of this worker can only have claimed finitely many generations.
        """
        while True:
            generation = self.current_generation()
            if int(self._store.add(f"{self._root}/g{generation}/claim/{self.rank}", 1)) == 1:
                return generation
            self.mark_failed(generation, f"{self._local_id} restarted and abandoned generation {generation}")

    def advance(self, generation: int) -> None:
        """Retire ``generation``: move the counter to ``generation + 1`` unless it already moved."""
        self._store.compare_set(f"{self._root}/gen", str(generation), str(generation + 1))

    def mark_failed(self, generation: int, reason: str) -> None:
        """Record why ``generation`` broke, then retire it (order matters: see module docstring)."""
        self._store.set(f"{self._root}/g{generation}/failed", reason)
        self.advance(generation)

    def failure_reason(self, generation: int) -> str | None:
        """Why ``generation`` broke, or None if it ended cleanly or is still live."""
        key = f"{self._root}/g{generation}/failed"
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode(errors="replace")

    def handshake(
        self, generation: int, backend: str, timeout_s: float, gpu_id: str = "", gone: Callable[[], bool] = bool
    ) -> str:
        """Announce our ``backend`` for ``generation``, wait up to ``timeout_s`` for the peer's, and
        return the backend both sides build the group with (each side computes the same answer).

        ``backend`` "cuda" (auto on a GPU) names our GPU (``gpu_id``, its UUID): two "cuda" sides agree
        on cuda_ipc when they share the GPU, else on nccl. Raises ``RuntimeError`` (the store's timeout
        error) if the peer does not show up in time, or if the two choices cannot meet; also as soon
        as ``gone()`` (asked at every poll) says the peer left the cluster.
        """
        hello = f"{self._root}/g{generation}/hello"
        mine = f"cuda@{gpu_id}" if backend == "cuda" else backend
        self._store.set(f"{hello}/{self.rank}", mine)
        peer_key = f"{hello}/{1 - self.rank}"
        deadline_s, poll_s = time.monotonic() + timeout_s, 0.001
        # Polled, not one long `wait`: `gone` must be heard mid-wait (and a timed-out TCPStore wait logs).
        while not self._store.check([peer_key]):
            if gone():
                raise RuntimeError("the peer left the cluster")
            if time.monotonic() >= deadline_s:
                raise RuntimeError(f"the peer's hello did not arrive within {timeout_s:.1f} s")
            time.sleep(min(poll_s, max(deadline_s - time.monotonic(), 0.0)))
            poll_s = min(poll_s * 2, HANDSHAKE_POLL_S)
        return agree_backend(mine, self._store.get(peer_key).decode())

    def create_group(self, generation: int, backend: str, timeout_s: float) -> Any:
        """Build this side's 2-rank gloo / NCCL group of ``generation`` (after ``handshake``, so quick).

        Each generation gets its own store namespace: a group never meets a stale incarnation's keys.
        """
        store = PrefixStore(f"{self._root}/g{generation}/pg/{backend}", self._store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend in ("gloo", "cuda_ipc"):  # cuda_ipc: gloo carries the framing and the IPC handles
            return ProcessGroupGloo(store, self.rank, 2, timeout)
        from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, self.rank, 2, options)


def agree_backend(mine: str, theirs: str) -> str:
    """The backend two hellos meet on (symmetric): equal names, or two GPUs (``cuda@<uuid>``): the
    same GPU → cuda_ipc, different GPUs → nccl. Raises ``RuntimeError`` when they cannot meet."""
    if mine.startswith("cuda@") and theirs.startswith("cuda@"):
        return "cuda_ipc" if mine == theirs else "nccl"
    if mine != theirs:
        raise RuntimeError(f"backend mismatch: this side uses {mine}, the peer {theirs}")
    return mine
