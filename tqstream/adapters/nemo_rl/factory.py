"""Building the data-plane client from NeMo-RL's configuration, and routing NeMo-RL's own factory
to it.

``build_data_plane_client(cfg, bootstrap=...)`` has NeMo-RL's factory's signature and rules (a
missing or disabled configuration is an error, not a fallback) for ``impl: tqstream``. NeMo-RL's
code calls its own factory, though; :func:`install` makes that factory build this adapter's client
for ``impl: tqstream`` and leaves every other ``impl`` to NeMo-RL. It acts in the process that
calls it, so it has to run in every process that builds a client: the driver, and each Ray worker
at start-up (from the job's ``worker_process_setup_hook``). A branch in NeMo-RL's own factory does
the same without it (docs/adapters/nemo_rl.md).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

from tqstream.adapters.nemo_rl.client import TQStreamDataPlaneClient
from tqstream.adapters.nemo_rl.config import IMPL
from tqstream.adapters.nemo_rl.errors import ConfigError

__all__ = ["build_data_plane_client", "install"]

_ROUTED = "_tqstream_routes_to"  # set on the wrapper install() puts in NeMo-RL's place


def build_data_plane_client(cfg: Mapping[str, Any] | None, *, bootstrap: bool = True) -> Any:
    """The data-plane client of NeMo-RL's ``data_plane`` configuration, ``impl: tqstream``.

    ``bootstrap``: True in the driver (it may start the cluster), False in workers (they attach).
    With ``observability.enabled`` the client is wrapped in NeMo-RL's metrics client, as NeMo-RL's
    factory does (NeMo-RL must be importable then)."""
    if cfg is None or not cfg.get("enabled", False):
        raise ConfigError(
            "the data plane is disabled (data_plane missing or data_plane.enabled is false): "
            "there is no data-plane client to build; enable it with impl: tqstream, or train "
            "with NeMo-RL's legacy grpo_train, which needs none"
        )
    impl = cfg.get("impl")
    if impl != IMPL:
        raise ConfigError(
            f"unknown data_plane impl for tqstream's factory: {impl!r}; set data_plane.impl: "
            f"{IMPL} (other impls are NeMo-RL's own)"
        )
    client = TQStreamDataPlaneClient(cfg, bootstrap=bootstrap)
    observe = cfg.get("observability") or {}
    if observe.get("enabled"):
        try:
            from nemo_rl.data_plane.observability import MetricsDataPlaneClient, log_event
        except ImportError as exc:
            client.close()
            raise ConfigError(
                f"data_plane.observability.enabled needs NeMo-RL's metrics client "
                f"(nemo_rl.data_plane.observability could not be imported: {exc})"
            ) from exc
        return MetricsDataPlaneClient(client, on_event=observe.get("callback") or log_event)
    return client


def install() -> bool:
    """Make NeMo-RL's ``build_data_plane_client`` build this adapter's client for ``impl:
    tqstream``, wherever it was imported from (the factory module, the ``nemo_rl.data_plane``
    package, modules that imported the name). Idempotent; False when NeMo-RL is not importable."""
    try:
        import nemo_rl.data_plane.factory as factory
    except ImportError:
        return False
    original = factory.build_data_plane_client
    if getattr(original, _ROUTED, None) is not None:
        return True
    routed = _route(original)
    for name, module in list(sys.modules.items()):
        if (name == "nemo_rl" or name.startswith("nemo_rl.")) and getattr(
            module, "build_data_plane_client", None
        ) is original:
            module.build_data_plane_client = routed  # type: ignore[attr-defined]
    return True


def _route(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build(cfg: Mapping[str, Any] | None, *args: Any, **kwargs: Any) -> Any:
        if cfg is not None and cfg.get("impl") == IMPL:
            return build_data_plane_client(cfg, *args, **kwargs)
        return original(cfg, *args, **kwargs)

    setattr(build, _ROUTED, original)
    return build
