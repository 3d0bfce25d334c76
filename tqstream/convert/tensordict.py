"""Columns to a TensorDict: what a read returns to the caller, dense fields as tensors, ragged ones
as jagged nested tensors (or padded, with their lengths), object fields as their Python values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import pyarrow as pa
import torch

from tqstream.convert import padding
from tqstream.errors import BatchShapeError, MalformedMessageError, SchemaError
from tqstream.protocol.columns import WIRE_NAMES, Column, field_error, jagged

if TYPE_CHECKING:  # tensordict is slow to import
    from tensordict import TensorDict

__all__ = ["decode_objects", "to_tensordict"]


def to_tensordict(
    n_rows: int,
    columns: Mapping[str, Column],
    *,
    padded: bool = False,
    pad_values: float | Mapping[str, float] = 0,
) -> TensorDict:
    """A TensorDict ``[n_rows]`` of the columns, aliasing their tensors where the layout allows.

    dense: the values tensor. ragged: a jagged nested tensor over values/offsets (zero copy), or
    with ``padded`` a dense ``[n, max_len, *shape]`` copy filled with the field's pad value plus
    its int64 lengths ``[n]`` under ``"<name>_lengths"``. object: a ``NonTensorStack`` of the
    decoded values (``td[name]`` is then a list, ``td.get(name)`` the stack).
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    out: dict[str, Any] = {}
    for name, col in columns.items():
        if col.n_rows != n_rows:
            raise field_error(BatchShapeError, name, f"has {col.n_rows} rows, expected {n_rows}")
        if col.offsets is None:
            out[name] = col.values
        elif col.schema.kind == "object":
            values = decode_objects(name, col)
            # tensordict < 0.11 cannot build an empty NonTensorStack (it reads its first row)
            out[name] = NonTensorStack(*values) if values else NonTensorData([], batch_size=[0])
        elif not padded:
            out[name] = jagged(col.values, col.offsets)
        else:
            key = f"{name}_lengths"
            if key in columns:
                msg = f"cannot pad: its lengths go under {key!r}, which is also a field being read"
                raise field_error(SchemaError, name, msg + "; rename it or read with padded=False")
            pad = pad_values.get(name, 0) if isinstance(pad_values, Mapping) else pad_values
            out[name], out[key] = _pad(name, col, pad)
    # every value was built here with n_rows rows on the CPU: tensordict's checks of each value
    # (~10 µs a field, ~45 µs a jagged one) have nothing to find
    unchecked = getattr(TensorDict, "_new_unsafe", None)
    if unchecked is None:  # pragma: no cover - a tensordict without it
        return TensorDict(out, batch_size=[n_rows])
    return unchecked(out, batch_size=torch.Size([n_rows]))


def _pad(name: str, col: Column, pad: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, longest, *shape]`` filled with ``pad``, each row copied once into place (the floor:
    one allocation, one fill, one copy; a zero pad needs no fill), and the lengths."""
    assert col.offsets is not None
    values, offsets, n = col.values, col.offsets, col.n_rows
    exact = values.dtype.is_floating_point or values.dtype.is_complex
    if not exact and torch.tensor(pad).to(values.dtype).item() != pad:  # e.g. -1 for uint8
        msg = f"pad value {pad!r} does not fit its dtype {WIRE_NAMES[values.dtype]}"
        raise field_error(SchemaError, name, msg + "; pass a representable value in pad_values")
    lengths = offsets[1:] - offsets[:-1]
    shape = (n, int(lengths.max()) if n else 0, *values.shape[1:])
    bits = _BITS.get(values.dtype)  # numpy lacks the dtype: its bits are copied
    src = values.numpy() if bits is None else values.view(bits).numpy()
    fill = torch.tensor([pad], dtype=values.dtype)
    zero = not fill.view(torch.uint8).any()  # 0, 0.0, False (not -0.0): calloc's pages are it
    out = padding.aligned_empty(shape, src.dtype, zeroed=zero)
    if not zero:
        out.fill((fill if bits is None else fill.view(bits))[0].item())
    padding.copy_rows(out, src, offsets.numpy())
    tensor = torch.from_numpy(out)
    return (tensor if bits is None else tensor.view(values.dtype)), lengths


_BITS = {torch.bfloat16: torch.int16}
"""Dtypes numpy lacks, and the int of their size whose numpy view carries their bits."""


def decode_objects(name: str, col: Column) -> list[Any]:
    """The Python values of an object column (str, bytes, or decoded JSON) in row order.

    JSON rows come back as JSON types: tuples as lists, dict keys as str, NaN as None, bytes nested
    in a value as base64 str. The bytes came from a peer, so they are validated (UTF-8 too).
    """
    assert col.offsets is not None
    n, kind = col.n_rows, col.schema.dtype
    if n == 0:
        return []
    data = col.values.contiguous().numpy()
    try:
        if kind in ("str", "bytes"):
            arrow_type = pa.large_string() if kind == "str" else pa.large_binary()
            buffers = [None, pa.py_buffer(col.offsets.contiguous().numpy()), pa.py_buffer(data)]
            array = pa.Array.from_buffers(arrow_type, n, buffers)
            array.validate(full=True)
            return array.to_pylist()
        view, offsets, decode = data.data, col.offsets.tolist(), msgspec.json.decode
        return [decode(view[offsets[i] : offsets[i + 1]]) for i in range(n)]
    except (pa.ArrowInvalid, UnicodeDecodeError, msgspec.DecodeError) as exc:
        msg = f"column {name!r}: object<{kind}> rows cannot be decoded ({exc})"
        raise MalformedMessageError(msg, column=name) from exc
