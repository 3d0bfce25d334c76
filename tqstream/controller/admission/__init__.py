"""Producer admission: how many samples the producers may start generating now. Pure state.

Producers ask before generating so that samples stay fresh (bounded staleness) and memory stays
bounded. The object lives at the controller and is global: every limit is a global number (all
producers, all data-parallel ranks together) and is applied once, never scaled by a DP size
(AReaL #1396). ``try_acquire`` never blocks; a caller that got fewer slots than it asked for waits,
and the service retries parked callers after every event that may free capacity (``release``,
``on_version``, ``on_version_recovered``, ``reset_staleness``).

Slot ids are issued here and a slot counts only while its id is live, so no slot can be counted
twice (verl #7938): a second release of an id is a no-op, and releasing an id never issued raises.
A full admission refuses, it never evicts: a queue that drops its oldest sample to make room
(verl's ``drop_oldest``) evicts the sample itself and releases its slot as ``dropped``, counted
apart. A ``rejected`` or ``dropped`` release gives its slot's staleness budget back in every style:
the sample never reaches the trainer, so counting it would let rejections starve the trainer and
deadlock a configuration that the constructor accepted.
"""

from __future__ import annotations

from collections.abc import Callable

from tqstream.controller.admission.base import Admission
from tqstream.controller.admission.capacity import CapacityAdmission
from tqstream.controller.admission.per_version import PerVersionAdmission
from tqstream.controller.admission.slots import SlotAdmission
from tqstream.errors import AdmissionError
from tqstream.types import AdmissionStyle, check_style

__all__ = [
    "Admission",
    "CapacityAdmission",
    "PerVersionAdmission",
    "SlotAdmission",
    "make_admission",
]


_STYLES: dict[AdmissionStyle, tuple[Callable[..., Admission], tuple[str, ...], tuple[str, ...]]] = {
    "capacity": (
        CapacityAdmission,
        ("max_concurrent", "max_staleness", "consumer_batch_size"),
        (),
    ),
    "per_version": (PerVersionAdmission, ("max_per_version", "update_interval"), ()),
    "slots": (SlotAdmission, ("max_pending_slots", "max_version_slots"), ("consumer_batch_size",)),
}


def make_admission(style: str, **config: int | None) -> Admission:
    """Build an admission of ``style`` from its config keys; refuses unknown or missing keys."""
    cls, required, optional = _STYLES[check_style(style)]
    valid_keys = ", ".join(sorted(required + optional))
    unknown = sorted(set(config) - set(required) - set(optional))
    missing = [k for k in required if k not in config]
    if unknown or missing:
        parts = [f"unknown config key(s) {unknown}"] if unknown else []
        parts += [f"missing config key(s) {missing}"] if missing else []
        raise AdmissionError(
            f"admission style {style!r}: {'; '.join(parts)}; valid keys: {valid_keys}",
            style=style,
        )
    return cls(**config)
