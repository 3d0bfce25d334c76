"""Trainer → rollout workers weight sync over a :class:`~.collective.Collective`, and through disk.

One sync is a few broadcasts from rank 0 (see ``layout.py`` for the byte stream):

1. a control record, ``int64[6]``: magic, policy version, metadata fingerprint, header length,
   stream length, number of ranges;
2. the ranges, ``int64[2 * n]`` (start, stop of each: ``layout.plan``);
3. the metadata header (names, dtypes, shapes; msgpack) — only when it changed since the last sync,
   so a steady run sends it once;
4. the ranges, all started at once (the group runs them in order, back to back); a packed range
   is filled while the earlier ones travel.

Receivers take part in every broadcast the control record announces before they check anything,
so a mismatch (other names, dtypes or shapes than a receiver expects, a receiver that missed the
header) is a :class:`~tqstream.errors.WeightMismatchError` on that receiver, never a hang of the
others or garbage weights.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from tqstream.errors import WeightMismatchError, WeightSyncError
from tqstream.reference.weightsync.collective import Collective
from tqstream.reference.weightsync.layout import WeightMeta, pack, plan, unpack

__all__ = ["SyncStats", "WeightReceiver", "WeightSender", "load_weights", "save_weights"]

MAGIC = 0x7153_5759  # "tqSWY": a control record of this protocol
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_DIRECT_BYTES = 1 << 20
"""Tensors of this size or more are broadcast from their own memory; smaller ones are packed."""


@dataclasses.dataclass(frozen=True)
class SyncStats:
    version: int
    nbytes: int
    broadcasts: int  # ranges of the stream: large tensors one each, small ones packed
    header_bytes: int  # 0 when the metadata was unchanged
    seconds: float
    receivers: int = 0  # that took the sync (a hub's members; every other rank of a fixed group)
    lost: tuple[int, ...] = ()  # a hub's members dropped in this sync (they failed it)


class _Packer:
    """The sender's stream for the weights' current metadata: their plan, and the buffers of the
    packed ranges (kept between syncs while the metadata is unchanged)."""

    def __init__(self, bucket_bytes: int, direct_bytes: int, device: torch.device) -> None:
        if bucket_bytes <= 0:
            raise WeightSyncError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes, self.direct_bytes, self.device = bucket_bytes, direct_bytes, device
        self.meta: WeightMeta | None = None
        self.plan: list[tuple[int, int, int]] = []
        self._buckets: dict[int, torch.Tensor] = {}  # packed range start -> its buffer

    def update(self, weights: Mapping[str, torch.Tensor]) -> WeightMeta:
        meta = WeightMeta.of(weights)
        if meta != self.meta:
            self.meta, self.plan = meta, plan(meta, self.bucket_bytes, self.direct_bytes)
            self._buckets = {  # packed ranges only: large tensors go from their own memory
                start: torch.empty(stop - start, dtype=torch.uint8, device=self.device)
                for start, stop, i in self.plan
                if i < 0
            }
        return meta

    def parts(self, weights: Mapping[str, torch.Tensor]) -> Iterator[torch.Tensor]:
        """Each range's bytes, in order; a packed range is filled when it is asked for (while the
        earlier ones travel)."""
        meta, device = self.meta, self.device
        assert meta is not None
        for start, stop, i in self.plan:
            if i >= 0:  # one large tensor: its own memory, no copy
                t = weights[meta.names[i]].detach()
                t = t if t.device == device and t.is_contiguous() else t.to(device).contiguous()
                yield t.reshape(-1).view(torch.uint8)
            else:
                part = self._buckets[start]
                pack(meta, weights, part, start, stop)
                yield part

    def start_head(
        self, c: Collective, version: int, header: bytes
    ) -> tuple[list[Callable[[], None]], list[torch.Tensor]]:
        """Start the control record, the range table and (when given) the header on ``c``; the
        waits, and the tensors that must live until they return."""
        meta, device = self.meta, self.device
        assert meta is not None
        ranges = self.plan
        control = [MAGIC, version, meta.fingerprint, len(header), meta.total, len(ranges)]
        held = [torch.tensor(control, dtype=torch.int64, device=device)]
        if ranges:
            table = [x for start, stop, _ in ranges for x in (start, stop)]
            held.append(torch.tensor(table, dtype=torch.int64, device=device))
        if header:
            held.append(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
        return [c.start_broadcast(t) for t in held], held


class WeightSender:
    """Rank 0's side of one group: ``send`` broadcasts to every other rank and blocks until each
    took every range (see :class:`~.hub.WeightHub` for receivers that come and go).

    Tensors of ``direct_bytes`` or more are broadcast from their own memory (when contiguous and on
    the collective's device); smaller ones are packed into buckets of up to ``bucket_bytes``,
    whose buffers are kept between syncs while the metadata is unchanged."""

    def __init__(
        self,
        collective: Collective,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        direct_bytes: int = DEFAULT_DIRECT_BYTES,
    ) -> None:
        if collective.rank != 0:
            raise WeightSyncError(f"the sender is rank 0 of the group, not {collective.rank}")
        self.collective = collective
        self._packer = _Packer(bucket_bytes, direct_bytes, collective.device)

    def send(self, weights: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        t0 = time.perf_counter()
        old = self._packer.meta
        meta = self._packer.update(weights)
        header = meta.encode() if meta != old else b""
        waits, held = self._packer.start_head(self.collective, version, header)
        for part in self._packer.parts(weights):  # every range in flight at once, in order
            waits.append(self.collective.start_broadcast(part))
            held.append(part)
        for wait in waits:
            wait()
        return SyncStats(version, meta.total, len(self._packer.plan), len(header),
                         time.perf_counter() - t0, self.collective.world_size - 1)  # fmt: skip


class WeightReceiver:
    """A rollout worker's side. ``expected``: the weights its model has (``WeightMeta.of(
    model.state_dict())``); without it, whatever is sent is accepted.

    ``receive`` returns views of a buffer reused by the next ``receive``: load them into the model
    (``load_state_dict`` / vLLM's ``load_weights`` copy) before receiving again."""

    def __init__(self, collective: Collective, expected: WeightMeta | None = None) -> None:
        self.collective = collective
        self.expected = expected
        self._meta: WeightMeta | None = None
        self._stream: torch.Tensor | None = None

    def receive(self, announced: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``announced``: the version the hub announced for this sync (``WeightSubscription.next``);
        a sync of another one is a :class:`WeightSyncError` (the two sides are out of step)."""
        c, device = self.collective, self.collective.device
        control = torch.zeros(6, dtype=torch.int64, device=device)
        c.broadcast(control)
        magic, version, fingerprint, header_bytes, total, n_ranges = control.tolist()
        if magic != MAGIC:
            raise WeightSyncError(
                f"rank {c.rank} received {magic:#x} where a weight-sync control record starts; "
                "the group's ranks are out of step (a rank called something other than "
                "send/receive on this group)",
                rank=c.rank,
            )
        ranges: list[tuple[int, int]] = []
        if n_ranges:
            table = torch.zeros(2 * n_ranges, dtype=torch.int64, device=device)
            c.broadcast(table)
            flat = table.tolist()
            ranges = list(zip(flat[::2], flat[1::2], strict=True))
        sent: WeightMeta | None = self._meta
        if header_bytes:
            header = torch.empty(header_bytes, dtype=torch.uint8, device=device)
            c.broadcast(header)
            sent = self._meta = WeightMeta.decode(header.cpu().numpy().tobytes())
        if self._stream is None or self._stream.numel() != total:
            self._stream = torch.empty(total, dtype=torch.uint8, device=device)
        stream = self._stream
        waits = [c.start_broadcast(stream[start:stop]) for start, stop in ranges]
        for wait in waits:
            wait()
        # every broadcast taken: now judge what came
        if sent is None or sent.fingerprint != fingerprint or sent.total != total:
            raise WeightMismatchError(
                f"rank {c.rank} received version {version}'s weights without their metadata (it "
                "joined after the first sync, or missed one): every receiver must take part in "
                "every sync from the first; restart the group",
                rank=c.rank,
                version=version,
            )
        if self.expected is not None and self.expected != sent:
            raise WeightMismatchError(
                f"rank {c.rank}: the weights of version {version} differ from this model's ("
                f"{self.expected.difference(sent)}); nothing was loaded — the trainer and the "
                "rollout engine must hold the same architecture",
                rank=c.rank,
                version=version,
            )
        if announced is not None and announced != version:
            raise WeightSyncError(
                f"rank {c.rank}: the trainer sent version {version} where {announced} was "
                "announced; the rollout side and the trainer are out of step",
                rank=c.rank,
                version=version,
            )
        return version, unpack(sent, stream)


def save_weights(path: str | Path, weights: Mapping[str, torch.Tensor], version: int) -> Path:
    """Write ``weights`` as a safetensors file tagged with ``version`` (atomically: readers see the
    old file or the new one, never a partial one)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in weights.items():
        t = t.detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        tensors[name] = t.clone() if key in seen else t  # safetensors refuses shared memory
        seen.add(key)
    meta = WeightMeta.of(tensors)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"version": str(version),
                                           "fingerprint": str(meta.fingerprint)})  # fmt: skip
    os.replace(tmp, path)
    return path


def load_weights(
    path: str | Path, expected: WeightMeta | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """``(version, weights)`` from :func:`save_weights`' file; ``expected`` as in
    :class:`WeightReceiver`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        info = f.metadata() or {}
        names = list(f.keys())
        weights = {name: f.get_tensor(name) for name in names}
    if "version" not in info:
        raise WeightMismatchError(f"{path} is not a tqstream weights file (no version in it)")
    sent = WeightMeta.of(weights)
    if expected is not None and expected != sent:
        ordered = {n: weights[n] for n in expected.names if n in weights}
        if WeightMeta.of(ordered) != expected or len(ordered) != len(weights):
            raise WeightMismatchError(
                f"the weights in {path} differ from this model's ({expected.difference(sent)})"
            )
        weights = ordered  # the file keeps names sorted; give them in the model's order
    return int(info["version"]), weights
