"""Trainer → rollout-worker weight sync: bucketed broadcasts over a process group of its own
(gloo on CPU, NCCL on GPUs), or a safetensors file."""

from tqstream.reference.weightsync.collective import Collective, TorchCollective
from tqstream.reference.weightsync.hub import WeightHub, WeightSubscription, member_receiver
from tqstream.reference.weightsync.layout import WeightMeta
from tqstream.reference.weightsync.sync import (
    SyncStats,
    WeightReceiver,
    WeightSender,
    load_weights,
    save_weights,
)

__all__ = [
    "Collective",
    "SyncStats",
    "TorchCollective",
    "WeightHub",
    "WeightMeta",
    "WeightReceiver",
    "WeightSender",
    "WeightSubscription",
    "load_weights",
    "member_receiver",
    "save_weights",
]
