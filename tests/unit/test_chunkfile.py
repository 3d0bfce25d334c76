"""A storage unit's checkpoint files (``storage/chunkfile.py``) and what a unit saves for a
``SaveUnit`` (``storage/checkpoint.py``): columns of every kind round-trip byte for byte, damage
is detected, and the rows of the order are saved as they were when it arrived, later drops and
puts landing meanwhile included."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import pytest
import torch

from tqstream.convert.inputs import columns_from_data
from tqstream.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from tqstream.protocol.columns import Column
from tqstream.protocol.messages import SaveUnit
from tqstream.storage import chunkfile
from tqstream.storage.checkpoint import UnitCheckpoints
from tqstream.storage.chunkfile import read_chunks, write_chunks
from tqstream.storage.columns import ColumnStore


def columns(rows: list[int], tag: int = 0) -> dict[str, Column]:
    return columns_from_data(
        {
            "dense": torch.tensor([[r, tag, r * tag] for r in rows], dtype=torch.int64),
            "half": torch.tensor([[r + 0.5] for r in rows], dtype=torch.bfloat16),
            "ragged": [torch.arange(r % 3, dtype=torch.float32) + tag for r in rows],  # some empty
            "text": [f"row {r} é" * (r % 2) for r in rows],
            "blob": [bytes([r, tag]) for r in rows],
            "json": [{"r": r, "tags": [tag, None]} for r in rows],
        }
    )[1]


def same(a: dict[str, Column], b: dict[str, Column]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].schema == b[name].schema, name
        assert torch.equal(a[name].values, b[name].values), name
        if a[name].offsets is None:
            assert b[name].offsets is None
        else:
            assert torch.equal(a[name].offsets, b[name].offsets), name


def test_every_kind_of_column_round_trips(tmp_path: Path) -> None:
    chunks = [(7, [0, 1, 2], columns([0, 1, 2], 1)), (9, [5], columns([5], 2))]
    nbytes = write_chunks(str(tmp_path / "f"), "part/with:odd name", chunks)
    assert nbytes == sum(c.nbytes for _, _, cols in chunks for c in cols.values())
    partition, back = read_chunks(str(tmp_path / "f"))
    assert partition == "part/with:odd name"
    assert [(c, rows) for c, rows, _ in back] == [(7, [0, 1, 2]), (9, [5])]
    for (_, _, want), (_, _, got) in zip(chunks, back, strict=True):
        same(want, got)


def _file(tmp_path: Path) -> str:
    path = str(tmp_path / "f")
    write_chunks(path, "p", [(1, [0, 1], columns([0, 1]))])
    return path


def test_a_flipped_byte_fails_the_crc(tmp_path: Path) -> None:
    path = _file(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[-70] ^= 0xFF  # inside the chunk's data
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="chunk 1 fails its CRC-32 check"):
        read_chunks(path)


def test_a_truncated_file_is_corrupt(tmp_path: Path) -> None:
    path = _file(tmp_path)
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CheckpointCorruptError, match="cut short"):
        read_chunks(path)


def test_other_files_missing_files_and_other_versions(tmp_path: Path) -> None:
    (tmp_path / "other").write_bytes(b"PK\x03\x04 not ours")
    with pytest.raises(CheckpointCorruptError, match="does not start like a tqstream chunk file"):
        read_chunks(str(tmp_path / "other"))
    with pytest.raises(CheckpointNotFoundError, match=r"does not exist.*they all share"):
        read_chunks(str(tmp_path / "missing"))
    header = msgspec.msgpack.encode(chunkfile.FileHeader(2, "p", []))
    raw = chunkfile.MAGIC + len(header).to_bytes(8, "little") + header
    (tmp_path / "newer").write_bytes(raw)
    with pytest.raises(
        CheckpointVersionError, match="chunk format 2; this tqstream reads format 1"
    ):
        read_chunks(str(tmp_path / "newer"))


# --- what a unit saves ---
def _saved(directory: str) -> dict[int, dict[str, list]]:
    """row -> field -> its values, over every file the unit wrote."""
    out: dict[int, dict[str, list]] = {}
    for name in os.listdir(directory):
        _, chunks = read_chunks(os.path.join(directory, name))
        for _, rows, cols in chunks:
            for i, row in enumerate(rows):
                for field, col in cols.items():
                    out.setdefault(row, {})[field] = col.take([i]).values.tolist()
    return out


def test_a_unit_saves_the_rows_as_they_were_when_the_order_came(tmp_path: Path) -> None:
    async def run() -> None:
        store = ColumnStore()
        store.add_chunk("p", 1, [0, 1, 2], columns([0, 1, 2]))
        store.add_chunk("p", 2, [0, 2], {"extra": columns([0, 2], 5)["dense"]})  # put_fields
        store.add_chunk("p", 3, [1], {"late": columns([1])["dense"]})  # put_fields in flight
        landing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        unit = UnitCheckpoints(store, lambda p: [landing] if p == "p" else [], lambda: "unit")
        order = SaveUnit(
            rid=0,
            directory=str(tmp_path / "u"),
            rows={"p": [0, 1, 2, 7]},  # row 7: a direct put whose columns are still landing
            before_chunk=20,
            skip_chunks=[3],
        )
        saving = asyncio.ensure_future(unit.save(order))
        store.add_chunk("p", 30, [3], columns([3]))  # put after the snapshot
        store.drop_rows("p", [0, 1])  # drops after the order: the snapshot still has them
        unit.landed("p", 11, [6, 7], columns([6, 7], 4))  # 6 was not in the snapshot
        landing.set_result(None)
        reply = await saving
        got = _saved(str(tmp_path / "u"))
        assert sorted(got) == [0, 1, 2, 7]
        assert set(got[0]) == {"dense", "half", "ragged", "text", "blob", "json", "extra"}
        assert "late" not in got[1] and "extra" not in got[1]
        assert got[7]["dense"] == [[7, 4, 28]]
        files = {f.name: f for f in reply.files}
        assert sorted(r for f in files.values() for r in f.row_ids) == [0, 1, 2, 7]
        assert store.bytes > 0 and store.missing("p", [0, 1]) == [0, 1]

    asyncio.run(run())


def test_rows_a_unit_lost_fail_the_save(tmp_path: Path) -> None:
    async def run() -> None:
        store = ColumnStore()
        store.add_chunk("p", 1, [0], columns([0]))
        unit = UnitCheckpoints(store, lambda p: [], lambda: "tcp://unit")
        order = SaveUnit(rid=0, directory=str(tmp_path / "u"), rows={"p": [0, 4]}, before_chunk=9)
        with pytest.raises(CheckpointError, match=r"tcp://unit does not hold 1 rows of .*'p'"):
            await unit.save(order)
        assert not (tmp_path / "u").exists()

    asyncio.run(run())


def test_groups_of_chunks_sharing_rows_stay_in_one_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tqstream.storage.checkpoint.FILE_BYTES", 1)  # a file per group

    async def run() -> list:
        store = ColumnStore()
        store.add_chunk("p", 1, [0, 1], columns([0, 1]))
        store.add_chunk("p", 2, [2, 3], columns([2, 3]))
        store.add_chunk("p", 3, [1, 2], {"adv": columns([1, 2])["dense"]})  # joins 1 and 2
        store.add_chunk("p", 4, [4], columns([4]))
        unit = UnitCheckpoints(store, lambda p: [], lambda: "unit")
        order = SaveUnit(
            rid=0, directory=str(tmp_path / "u"), rows={"p": [0, 1, 2, 3, 4]}, before_chunk=9
        )
        return (await unit.save(order)).files

    files = asyncio.run(run())
    assert sorted(f.row_ids for f in files) == [[0, 1, 2, 3], [4]]
