"""The process's default cluster: what code that is given no client uses.

Adapters that a framework constructs with its own arguments (AReaL's ``StalenessManager``) have no
client passed to them. They take this process's default: a connection to the cluster named by
``TQSTREAM_ADDRESS`` (with ``TQSTREAM_KEYS`` when it needs keys) when the environment names one,
else a cluster embedded in this process (``tqstream.init()``). One per process, made on first
use, shared by every caller, closed at exit; a forked child makes its own.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from tqstream.config import ADDRESS_ENV, environment

if TYPE_CHECKING:
    from tqstream.client.client import Client

__all__ = ["default_client"]

_lock = threading.Lock()
_client: Client | None = None
_pid = 0


def default_client() -> Client:
    """This process's default client (see the module docstring); ``ConnectError`` when
    ``TQSTREAM_ADDRESS`` names a cluster that does not answer."""
    global _client, _pid
    with _lock:
        if _client is not None and _pid == os.getpid() and not _client.closed:
            return _client
        address = environment(ADDRESS_ENV)
        if address:
            from tqstream.client.client import connect

            client = connect(address)
        else:
            from tqstream.launch.embedded import init

            client = init()
        if not _pid:
            atexit.register(_close)
        _client, _pid = client, os.getpid()
        return client


def _close() -> None:
    with _lock:
        if _client is not None and _pid == os.getpid():
            _client.close()
