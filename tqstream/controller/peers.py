"""Who made a request: the peer (client session) behind a request handle."""

from __future__ import annotations

from typing import Any


def peer_of(handle: Any) -> Any:
    """The peer a request handle (the service's responder) came from; None for handles without
    one (requests made in unit tests, or by the state itself)."""
    return getattr(handle, "peer", None)
