"""The CURVE key file: private, never overwritten, every defect named; the ZAP handler of a
context lives exactly as long as the servers that admit through it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import zmq

import tqstream
from tqstream.protocol import auth


def test_generate_then_load(tmp_path: Path) -> None:
    path = tmp_path / "k"
    made = tqstream.generate_keys(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    loaded = auth.load_keys(path)
    assert loaded == made and loaded.path == str(path)
    assert zmq.curve_public(loaded.server_secret) == loaded.server_public
    assert loaded.server_public != loaded.client_public
    assert repr(loaded) == f"Keys({str(path)!r})"  # never the secrets
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "k"
    made = tqstream.generate_keys(path)
    with pytest.raises(tqstream.KeyFileError) as err:
        tqstream.generate_keys(path)
    assert f"the key file {path} exists already" in str(err.value)
    assert auth.load_keys(path) == made
    assert auth.ensure_keys(path) == made


def test_ensure_makes_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "k"
    made = auth.ensure_keys(path)
    assert auth.load_keys(path) == made


def test_unwritable_place(tmp_path: Path) -> None:
    with pytest.raises(tqstream.KeyFileError) as err:
        tqstream.generate_keys(tmp_path / "no" / "such" / "dir")
    assert "cannot write the key file" in str(err.value)


def _valid(tmp_path: Path) -> dict[str, object]:
    tqstream.generate_keys(tmp_path / "good")
    return dict(json.loads((tmp_path / "good").read_text()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tqstream_keys": 2}, "not a tqstream key file (no tqstream_keys: 1)"),
        ({"client_secret": None}, "client_secret must be a CURVE key as 40 characters of Z85 text"),
        (
            {"server_public": "x" * 39},
            "server_public must be a CURVE key as 40 characters of Z85 text",
        ),
        ({"server_public": "~" * 40}, "server_public is not Z85 text"),
        ({"client_public": "swap"}, "client_public is not the public key of client_secret"),
    ],
)
def test_defects_are_named(tmp_path: Path, change: dict[str, object], message: str) -> None:
    value = _valid(tmp_path)
    if change.get("client_public") == "swap":
        change = {"client_public": value["server_public"]}
    value.update(change)
    path = tmp_path / "bad"
    path.write_text(json.dumps(value))
    with pytest.raises(tqstream.KeyFileError) as err:
        auth.load_keys(path)
    assert str(err.value) == f"the key file {path} is not a valid tqstream key file: {message}"


def test_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(tqstream.KeyFileError, match="is not a valid tqstream key file"):
        auth.load_keys(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(tqstream.KeyFileError) as err:
        auth.load_keys(tmp_path / "k")
    assert str(err.value).startswith(f"cannot read the key file {tmp_path / 'k'}: No such file")
    assert "tqstream-launch --keys" in str(err.value)


def _zap_threads() -> int:
    return sum(t.name == "tqstream-zap" for t in threading.enumerate())


def test_one_zap_handler_per_context_while_servers_use_it(tmp_path: Path) -> None:
    a, b = (tqstream.generate_keys(tmp_path / n) for n in "ab")
    ctx = zmq.Context()
    try:
        before = _zap_threads()
        auth.admit(ctx, a)
        auth.admit(ctx, a)
        auth.admit(ctx, b)
        assert _zap_threads() == before + 1
        auth.release(ctx, a)
        auth.release(ctx, b)
        assert _zap_threads() == before + 1  # a is still admitted once
        auth.release(ctx, a)
        assert _zap_threads() == before
        auth.release(ctx, a)  # one too many: nothing to undo
        auth.admit(ctx, b)  # the endpoint is free again
        assert _zap_threads() == before + 1
        auth.release(ctx, b)
    finally:
        ctx.destroy(linger=0)


def test_another_zap_handler_in_the_context(tmp_path: Path) -> None:
    keys = tqstream.generate_keys(tmp_path / "k")
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.REP)
    squatter.bind(auth.ZAP_ENDPOINT)
    try:
        with pytest.raises(OSError, match="cannot bind the authentication handler"):
            auth.admit(ctx, keys)
    finally:
        squatter.close(0)
        ctx.destroy(linger=0)
