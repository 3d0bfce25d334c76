"""The one collective a weight sync needs — a broadcast from the trainer (rank 0) — over a process
group of its own.

The group is made from a ``TCPStore`` rendezvous and a backend process group object
(``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPUs), never through
``torch.distributed.init_process_group``: the trainer's own default group (FSDP, DDP) and the
rollout engine's (vLLM's tensor parallelism) stay untouched, and the sync group joins processes that
belong to different jobs. Rank 0 hosts the store.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tqstream.errors import WeightSyncError, WeightSyncTimeoutError

__all__ = ["Collective", "TorchCollective", "backend_device", "connect_store"]

_PEER_GONE = ("timeout", "timed out", "connection closed", "reset by peer")
"""What the backends' errors say when a peer did not take part (lower case)."""


def connect_store(host: str, port: int, timeout: float, host_it: bool = False) -> Any:
    """A ``TCPStore`` at ``host:port``: hosted here (``host_it``; ``port`` 0 takes a free one) or
    reached as a client."""
    try:
        delta = datetime.timedelta(seconds=timeout)
        return dist.TCPStore(host, port, None, host_it, timeout=delta, wait_for_workers=False)
    except (RuntimeError, TimeoutError) as exc:
        raise WeightSyncTimeoutError(
            f"could not reach the weight-sync rendezvous at {host}:{port} within {timeout}s: "
            f"{str(exc).splitlines()[0]}; is the trainer up, and is the address right?"
        ) from exc


def backend_device(backend: str, device: torch.device | str | None = None) -> torch.device:
    """Where ``backend``'s tensors live: the CPU for gloo, ``device`` (default: the current CUDA
    device) for nccl; an unknown backend, or nccl without CUDA, is a :class:`WeightSyncError`."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        if getattr(dist, "ProcessGroupNCCL", None) is None or not torch.cuda.is_available():
            raise WeightSyncError(
                "the nccl backend needs a CUDA device and a CUDA build of torch; use backend='gloo'"
            )
        return torch.device(device or f"cuda:{torch.cuda.current_device()}")
    raise WeightSyncError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")


class Collective(Protocol):
    """What a weight sync needs of its transport."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Send ``tensor`` (on ``src``) into ``tensor`` on every rank; blocks until done."""

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Callable[[], None]:
        """Start a broadcast and return the call that waits for it (operations of one group run
        in the order they were started)."""

    def close(self) -> None: ...


class TorchCollective:
    """A broadcast group of ``world_size`` processes: the trainer (rank 0) and the receivers.

    ``backend`` "gloo" (CPU tensors) or "nccl" (CUDA tensors on ``device``). Every rank gives the
    same ``host``/``port``; rank 0 listens there (``port=0``: any free port, read it from
    ``port`` and hand it to the others). The group assembles at the first broadcast; a broadcast
    (or the assembly) that some rank does not join within ``timeout`` seconds raises
    :class:`WeightSyncTimeoutError`. ``store``: rendezvous in this store (a ``PrefixStore`` of one
    that several groups share) instead of one at ``host``/``port``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        store: Any = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise WeightSyncError(f"rank {rank} is not in a group of {world_size}", rank=rank)
        if rank and not port and store is None:
            raise WeightSyncError("ranks other than 0 need the port rank 0 listens on", rank=rank)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timeout
        self._delta = datetime.timedelta(seconds=timeout)
        self.device = backend_device(backend, device)
        if store is None:
            store = connect_store(host, port, timeout, host_it=rank == 0)
        self.store = store
        self.port: int = getattr(store, "port", port)
        self.group: Any = None  # made by the first broadcast: every rank must be there by then

    def join(self) -> Any:
        """Assemble the group now (else the first broadcast does), waiting up to ``timeout`` for
        every rank; returns the backend process group."""
        if self.group is None:
            try:
                if self.backend == "gloo":
                    self.group = dist.ProcessGroupGloo(
                        self.store, self.rank, self.world_size, self._delta
                    )
                else:
                    nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
                    torch.cuda.set_device(self.device)
                    options = nccl.Options()
                    options._timeout = self._delta
                    self.group = nccl(self.store, self.rank, self.world_size, options)
            except RuntimeError as exc:
                raise WeightSyncTimeoutError(
                    f"the weight-sync group of {self.world_size} did not assemble within "
                    f"{self.timeout}s on rank {self.rank}: {str(exc).splitlines()[0]}",
                    rank=self.rank,
                ) from exc
        return self.group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.start_broadcast(tensor, src)()

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Callable[[], None]:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        group = self.join()
        try:
            work = group.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise self._error(exc) from exc

        def wait() -> None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._error(exc) from exc

        return wait

    def _error(self, exc: RuntimeError) -> WeightSyncError:
        text = str(exc).splitlines()[0].split(" This is typically")[0]
        lower = text.lower()
        if "reset by peer" in lower or "connection closed" in lower:
            return WeightSyncTimeoutError(
                f"a weight-sync broadcast failed on rank {self.rank} of {self.world_size}: a peer "
                f"went away mid-sync (its process died or closed the group); {text}",
                rank=self.rank,
                timeout=self.timeout,
            )
        if any(w in lower for w in _PEER_GONE):
            return WeightSyncTimeoutError(
                f"a weight-sync broadcast did not complete within {self.timeout}s on rank "
                f"{self.rank} of {self.world_size}: a peer did not take part (it died, or never "
                f"called receive); {text}",
                rank=self.rank,
                timeout=self.timeout,
            )
        return WeightSyncError(f"weight-sync broadcast failed on rank {self.rank}: {text}",
                               rank=self.rank)  # fmt: skip

    def close(self) -> None:
        """Drop the group (idempotent)."""
        self.group = None
        self.store = None  # type: ignore[assignment]
