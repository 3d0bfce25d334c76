"""tqstream for verl: ``DataProto`` ⇄ rows, the fully-async recipe's queue and slots, AsyncRL.

- :func:`dataproto_to_rows` / :func:`rows_to_dataproto` — any ``DataProto`` as rows (a rollout
  unpadded, ``uid`` as the group, numeric ``non_tensor_batch`` arrays as fields and object values
  exactly encoded in the row's layout field, ``meta_info`` kept) and back, a rollout re-padded to
  the trainer's widths; a put's rows give back an equal ``DataProto``.
- :class:`VerlExperience` — ``put_experience(DataProto, v)`` / ``get_experience(n, v)`` through a
  staleness window measured from the dispatch version (verl v1, AsyncRL).
- :class:`MessageQueue`, :class:`MessageQueueClient` — the fully-async recipe's queue and its
  client: the recipe runs with only its import changed; its pickled samples are stored as opaque
  bytes; a full queue applies back-pressure, or (``drop_oldest=True``) drops its oldest sample.
- :class:`ReplayBufferSlots` — ``acquire_slot()`` / ``release_slot()`` / ``reset_staleness()`` of
  the fully-async TransferQueue recipe, as verl calls them.
- :class:`AsyncRLExperience` — the AsyncRL recipe's ``async_put_experience`` /
  ``async_get_experience``, one request with a real window.

Importing this module imports ``verl.protocol`` (an ImportError naming the install command if verl
is missing).
docs/adapters/verl.md shows how to wire each into verl's trainers.
"""

from __future__ import annotations

from tqstream.adapters import require

require("verl.protocol", "verl", "pip install verl==0.9.1")

from tqstream.adapters.verl.asyncrl import AsyncRLExperience  # noqa: E402
from tqstream.adapters.verl.dataproto import RowBatch, dataproto_to_rows, stored_fields  # noqa: E402
from tqstream.adapters.verl.experience import VerlBatch, VerlExperience  # noqa: E402
from tqstream.adapters.verl.layout import DERIVED_FIELDS, LAYOUT_FIELD, RESPONSE_FIELDS  # noqa: E402
from tqstream.adapters.verl.queue import MessageQueue, MessageQueueClient  # noqa: E402
from tqstream.adapters.verl.rebuild import rows_to_dataproto  # noqa: E402
from tqstream.adapters.verl.slots import ReplayBufferSlots  # noqa: E402

__all__ = [
    "DERIVED_FIELDS",
    "LAYOUT_FIELD",
    "RESPONSE_FIELDS",
    "AsyncRLExperience",
    "MessageQueue",
    "MessageQueueClient",
    "ReplayBufferSlots",
    "RowBatch",
    "VerlBatch",
    "VerlExperience",
    "dataproto_to_rows",
    "rows_to_dataproto",
    "stored_fields",
]
