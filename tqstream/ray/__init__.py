"""The Ray deployment: the controller and the storage units as Ray actors.

    cluster = tqstream.ray.launch(name="tqstream")       # in the job's driver: one unit per node
    client = tqstream.ray.connect(name="tqstream")       # in any task or actor of the job
    cluster.close()                                      # or the driver's exit

Ray is placement, discovery and lifecycle only: clients find the controller actor by name, then
every byte moves over tqstream's own sockets (shared memory with a storage unit on the same host),
never through the Ray object store. A storage-unit actor that dies is a lost unit (its rows are
counted lost unless ``replicas=2``); Ray restarts it at its address, where the controller revives
it. docs/deployment.md compares the three deployments.

Importing this package imports Ray (``pip install "tqstream[ray]"``); ``import tqstream`` does not.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401  (the top-level Ray: imports here are absolute)
except ImportError as exc:
    raise ImportError(
        f"tqstream.ray needs Ray (import ray failed: {exc}); install it with: pip install "
        f'"tqstream[ray]"'
    ) from exc

from tqstream.ray.cluster import RayCluster, connect, launch, shutdown

__all__ = ["RayCluster", "connect", "launch", "shutdown"]
