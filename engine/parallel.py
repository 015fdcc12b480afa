"""The one communicator object tensor-parallel layers talk to.

Layers never call torch.distributed directly: they hold a `TensorParallelGroup` and the row-parallel
linear layer is the only place that calls `all_reduce`. A single-rank group is the colocated case.

The group talks to its process group object directly (`pg.allreduce(...)` → work → `work.wait`), never
through `torch.distributed.all_reduce`: that needs a global default group, and a worker process also
holds several independent per-pair groups for KV transfer, so none of them may be "the" default.
Every collective is bounded by a timeout: a dead or hung peer raises `CollectiveError`, never hangs.
"""

from __future__ import annotations

import datetime

import torch

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
_MIN_TIMEOUT_S = 0.001  # a zero timedelta means "no timeout" to c10d: never pass one


class CollectiveError(RuntimeError):
    """A collective of the tensor-parallel group failed: a peer crashed, timed out, or broke the group.

    Fatal to the group: the ranks may now disagree about which collective comes next, so the whole
    instance must be torn down and rebuilt with a new group.
    """


def _gloo_group(store, rank: int, size: int, timeout: datetime.timedelta):
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout), torch.device("cpu")


def _nccl_group(store, rank: int, size: int, timeout: datetime.timedelta):
    if not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    # The caller picks this rank's GPU (torch.cuda.set_device) before forming the group.
    return ProcessGroupNCCL(store, rank, size, options), torch.device("cuda", torch.cuda.current_device())


BACKENDS = {"gloo": _gloo_group, "nccl": _nccl_group}


def new_process_group(backend: str, store, rank: int, size: int, timeout_s: float):
    """(process group object, device its tensors live on), rendezvousing in `store`; blocks until all
    `size` ranks joined (gloo) and is never registered as torch.distributed's default group."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown tensor-parallel backend {backend!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[backend](store, rank, size, datetime.timedelta(seconds=timeout_s))


class TensorParallelGroup:
    """rank/size of this process in its TP group, and the group's collectives.

    `process_group` is a gloo or NCCL process group object (size > 1 only). `device` is where tensors
    handed to its collectives must live (cpu for gloo, this rank's GPU for NCCL). `timeout_s` bounds
    every collective that does not pass its own.
    """

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        process_group=None,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        device: torch.device | str = "cpu",
    ):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
        if size > 1 and process_group is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a torch.distributed process group")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self._process_group = process_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` across ranks, in place; returns it."""
        if self.size > 1:
            self._collective("all_reduce", tensor, lambda pg, buf, timeout: pg.allreduce(buf, timeout=timeout))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, timeout_s: float | None = None) -> torch.Tensor:
        """Overwrite `tensor` on every rank with `src_rank`'s, in place; returns it.

        Every rank must pass a tensor of the same shape and dtype. `timeout_s` (default: the group's)
        lets a receiver wait less than a collective may take, e.g. for heartbeats.
        """
        if self.size > 1:
            self._collective(
                "broadcast", tensor, lambda pg, buf, timeout: pg.broadcast(buf, src_rank, timeout), timeout_s
            )
        return tensor

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's equal share of `total` items; refuses uneven splits by name."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size

    def close(self) -> None:
        """Drop the process group (its sockets close; peers still waiting on it see a failure)."""
        group, self._process_group = self._process_group, None
        if group is not None and hasattr(group, "abort"):
            group.abort()  # NCCL: a pending op would otherwise keep the communicator busy

    def _collective(self, what: str, tensor: torch.Tensor, post, timeout_s: float | None = None) -> None:
        if self._process_group is None:
            raise CollectiveError(f"tensor-parallel {what} on rank {self.rank}: the group is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        timeout = datetime.timedelta(seconds=max(timeout_s, _MIN_TIMEOUT_S))
        # Backends reduce contiguous buffers only; a strided view is staged and copied back.
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        try:
            # The op carries the timeout (the backend gives up and frees its buffers) and the wait
            # carries it too (NCCL's wait is where a stuck kernel is noticed).
            post(self._process_group, buffer, timeout).wait(timeout)
        except RuntimeError as exc:  # DistError and backend errors (timeouts, closed connections)
            raise CollectiveError(
                f"tensor-parallel {what} failed on rank {self.rank} of {self.size} "
                f"(timeout {timeout_s:g} s): {_first_line(exc)}"
            ) from None
        if buffer is not tensor:
            tensor.copy_(buffer)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


SINGLE_RANK = TensorParallelGroup()
