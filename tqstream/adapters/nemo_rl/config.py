"""The adapter's settings, read from NeMo-RL's ``data_plane`` configuration dict.

NeMo-RL selects its data plane with ``data_plane.impl``; with ``impl: tqstream`` this adapter reads
the keys NeMo-RL already has (``enabled``, ``controller_address``, the storage-unit count of the
``simple:`` block) and a ``tqstream:`` block of its own::

    data_plane:
      enabled: true
      impl: tqstream
      claim_meta_poll_interval_s: 0.5     # NeMo-RL requires the key; claims wait at the controller
      controller_address: tcp://10.0.0.5:5555   # optional: a running cluster (tqstream-launch)
      tqstream:
        launch: ray                       # how the driver (bootstrap=True) starts a cluster
        storage_units: 2

Keys of TransferQueue's own (``backend``, ``mooncake_cpu:``, sizes) are not read: tqstream sizes
its storage per put and has one backend.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

from tqstream.adapters.nemo_rl.errors import ConfigError

__all__ = ["IMPL", "TQStreamDataPlaneConfig"]

IMPL = "tqstream"
"""The ``data_plane.impl`` value that selects this adapter."""

Launch = Literal["ray", "embedded", "processes"]


@dataclasses.dataclass(frozen=True)
class TQStreamDataPlaneConfig:
    address: str = ""
    """``tcp://HOST:PORT`` of a running cluster (NeMo-RL's ``controller_address``, or
    ``tqstream.address``); every process connects to it and nobody starts one."""
    launch: Launch = "ray"
    """Without an address, what the driver (``bootstrap=True``) starts: ``ray`` (actors found by
    name from every Ray worker; an existing cluster of that name is reused), ``embedded`` (in the
    driver's process) or ``processes`` (child processes). Workers (``bootstrap=False``) attach:
    by name under Ray, else through the address the driver wrote into the configuration."""
    storage_units: int | None = None
    """Storage units to start (default: ``simple.num_storage_units``, else one per Ray node, else
    one)."""
    ray_name: str = "tqstream"
    """Name of the Ray-launched cluster (its controller actor is ``<name>-controller``)."""
    ray_namespace: str | None = None
    """Ray namespace of that cluster (None: the job's)."""
    claim_lease_timeout_s: float = 86400.0
    """How long a claim stays leased to a live claimer that neither closes nor clears it; then its
    rows go back to the task. A claimer that dies gives them back at once."""
    non_tensor_fields: Literal["store", "reject"] = "store"
    """``store``: non-tensor leaves (``NonTensorStack``, object arrays) of str, bytes or JSON
    values are stored as such (never pickled); ``reject``: any non-tensor leaf raises TypeError."""
    version_tag: str = "weight_version"
    """The tag whose int value is a new row's policy version (NeMo-RL stamps the rollout's start
    weight under it), so the controller's staleness windows and samplers see it."""
    group_key_pattern: str = r"(?P<group>.+)_g\d+"
    """Keys of new rows that match it (``re.fullmatch``) get its ``group`` as their group (NeMo-RL's
    keys are ``{prompt uid}_g{i}``), so samplers read whole prompt groups; "" disables."""

    def __post_init__(self) -> None:
        if self.launch not in ("ray", "embedded", "processes"):
            raise ConfigError(
                f"tqstream.launch must be 'ray', 'embedded' or 'processes', got {self.launch!r}"
            )
        if self.storage_units is not None and (
            not isinstance(self.storage_units, int) or self.storage_units < 1
        ):
            raise ConfigError(
                f"tqstream.storage_units must be an int >= 1, got {self.storage_units!r}"
            )
        if not self.claim_lease_timeout_s > 0:
            raise ConfigError(
                f"tqstream.claim_lease_timeout_s must be > 0 seconds, got "
                f"{self.claim_lease_timeout_s!r}"
            )
        if self.non_tensor_fields not in ("store", "reject"):
            raise ConfigError(
                f"tqstream.non_tensor_fields must be 'store' or 'reject', got "
                f"{self.non_tensor_fields!r}"
            )
        if self.address and not self.address.startswith("tcp://"):
            raise ConfigError(
                f"the tqstream controller address must look like tcp://HOST:PORT, got "
                f"{self.address!r}"
            )
        try:
            pattern = re.compile(self.group_key_pattern) if self.group_key_pattern else None
        except re.error as exc:
            raise ConfigError(
                f"tqstream.group_key_pattern is not a regular expression: {exc}"
            ) from exc
        if pattern is not None and "group" not in pattern.groupindex:
            raise ConfigError(
                f"tqstream.group_key_pattern {self.group_key_pattern!r} needs a named group "
                f"(?P<group>...) giving the prompt group of a key"
            )

    @classmethod
    def from_dataplane_config(cls, cfg: Mapping[str, Any]) -> TQStreamDataPlaneConfig:
        """Settings from NeMo-RL's ``data_plane`` dict (a plain dict or its pydantic form)."""
        block = _plain(cfg.get(IMPL)) or {}
        if not isinstance(block, Mapping):
            raise ConfigError(
                f"data_plane.tqstream must be a mapping of settings, got {type(block).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ConfigError(
                f"unknown data_plane.tqstream settings {unknown}; known: {sorted(known)}"
            )
        values = dict(block)
        address = cfg.get("controller_address")
        if address and "address" not in values:
            values["address"] = address
        if "storage_units" not in values:
            simple = _plain(cfg.get("simple")) or {}
            units = simple.get("num_storage_units") if isinstance(simple, Mapping) else None
            values["storage_units"] = units or cfg.get("num_storage_units")
        return cls(**values)


def _plain(value: Any) -> Any:
    """A pydantic block (NeMo-RL validates its config with pydantic) as a dict."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_unset=True) if callable(dump) else value
