"""One cluster configuration: every setting under one name for the keywords, the flags and the
environment; old names warn, bad values are refused with the setting named; the children get
their component's configuration whole."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest

import tqstream
from tqstream.config import (
    DEPRECATED,
    PER_UNIT,
    ClusterConfig,
    ControllerConfig,
    StorageConfig,
    cluster_config,
    cluster_settings,
)
from tqstream.errors import ConfigError
from tqstream.launch import embedded, processes

DOCS = Path(__file__).resolve().parents[2] / "docs"

CANONICAL = [
    "storage_units",
    "host",
    "port",
    "max_message_bytes",
    "keys",
    "connect_timeout",
    "heartbeat_interval",
    "lease_timeout",
    "put_timeout",
    "storage_timeout",
    "replicas",
    "metrics_port",
    "max_rows",
    "durability",
    "journal",
    "fsync_interval",
    "snapshot_records",
    "reconnect_grace",
    "storage_max_bytes",
]


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*cluster_settings(), *DEPRECATED]:
        monkeypatch.delenv(f"TQSTREAM_{name.upper()}", raising=False)


def test_every_field_is_one_setting() -> None:
    settings = cluster_settings()
    assert list(settings) == CANONICAL
    paths = [p for s in settings.values() for p in s.paths]
    assert len(paths) == len(set(paths))
    fields = ["storage_units"]
    fields += [f"controller.{f.name}" for f in dataclasses.fields(ControllerConfig)]
    fields += [
        f"storage.{f.name}" for f in dataclasses.fields(StorageConfig) if f.name not in PER_UNIT
    ]
    assert sorted(paths) == sorted(fields)
    assert settings["storage_max_bytes"].paths == ("storage.max_bytes",)
    assert settings["keys"].paths == ("controller.keys", "storage.keys")
    assert all(s.doc for s in settings.values())


def test_a_shared_setting_sets_both_components() -> None:
    config = ClusterConfig(storage_units=3).with_settings(
        keys="k.keys", max_message_bytes=1 << 20, connect_timeout=2.5, storage_max_bytes=7
    )
    assert config.storage_units == 3
    for part in (config.controller, config.storage):
        assert (part.keys, part.max_message_bytes, part.connect_timeout) == ("k.keys", 1 << 20, 2.5)
    assert config.storage.max_bytes == 7 and config.storage.port == 0
    assert config.with_settings(port=5555).controller.port == 5555  # the controller's only
    assert config.with_settings(lease_timeout=None) == config  # None: left as it is


def test_the_environment_then_explicit_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQSTREAM_STORAGE_MAX_BYTES", "1000")
    monkeypatch.setenv("TQSTREAM_STORAGE_TIMEOUT", "2.5")
    monkeypatch.setenv("TQSTREAM_KEYS", "env.keys")
    config = cluster_config(None, storage_timeout=4.0)
    assert config.storage.max_bytes == 1000 and config.controller.storage_timeout == 4.0
    assert config.storage.keys == config.controller.keys == "env.keys"
    assert cluster_config(ClusterConfig()) == ClusterConfig()  # a config given is taken whole
    monkeypatch.setenv("TQSTREAM_REPLICAS", "two")
    with pytest.raises(ConfigError, match="TQSTREAM_REPLICAS='two' is not a valid int"):
        ClusterConfig.from_env()


def test_an_old_variable_warns_and_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQSTREAM_MAX_BYTES", "1000")
    with pytest.warns(DeprecationWarning, match="TQSTREAM_MAX_BYTES.*TQSTREAM_STORAGE_MAX_BYTES"):
        assert ClusterConfig.from_env().storage.max_bytes == 1000
    monkeypatch.setenv("TQSTREAM_STORAGE_MAX_BYTES", "2000")
    with pytest.raises(ConfigError, match="both were given"):
        ClusterConfig.from_env()


@pytest.mark.parametrize(("old", "new"), sorted(DEPRECATED.items()))
def test_an_old_keyword_warns_naming_the_new_one_and_works(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"use {new!r}") as caught:
        config = ClusterConfig().with_settings(**{old: 2})
    assert config == ClusterConfig().with_settings(**{new: 2})
    assert caught[0].filename == __file__  # the warning names the caller's line
    with pytest.raises(ConfigError, match=f"{old!r} is the deprecated name of {new!r}"):
        ClusterConfig().with_settings(**{old: 2, new: 2})


def test_the_canonical_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClusterConfig().with_settings(storage_units=1, storage_max_bytes=1, replicas=1)


def test_an_unknown_setting_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="unknown cluster setting 'lease_timout'") as err:
        ClusterConfig().with_settings(lease_timout=5)
    assert "did you mean 'lease_timeout'?" in str(err.value)
    assert "storage_max_bytes" in str(err.value)  # it lists the settings
    with pytest.raises(ConfigError, match=r"config must be a tqstream\.ClusterConfig"):
        cluster_config(tqstream.ClientConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "value", "why"),
    [
        ("storage_units", 0, "must be at least 1"),
        ("storage_units", -2, "must be at least 1"),
        ("replicas", 3, "must be 1 or 2"),
        ("lease_timeout", -1.0, "must be >= 0"),
        ("lease_timeout", math.nan, "must be >= 0"),
        ("storage_max_bytes", -5, "must be >= 0"),
        ("port", 70000, r"must be a TCP port \(0 to 65535\)"),
        ("lease_timeout", "5", "must be a number"),
        ("max_rows", 1.5, "must be an int"),
        ("max_rows", True, "must be an int"),
        ("keys", 3, "must be a str"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting(setting: str, value: Any, why: str) -> None:
    s = cluster_settings()[setting]
    with pytest.raises(
        ConfigError, match=rf"^{setting} {why}, got .*\(tqstream-launch {s.flag}, {s.env}\)$"
    ):
        ClusterConfig().with_settings(**{setting: value})


def test_the_components_of_a_cluster_agree() -> None:
    with pytest.raises(ConfigError, match="a cluster has one key file"):
        ClusterConfig(controller=ControllerConfig(keys="k.keys"))
    with pytest.raises(ConfigError, match="a cluster has one interface to bind"):
        ClusterConfig(storage=StorageConfig(host="0.0.0.0"))
    with pytest.raises(ConfigError, match="storage units of a cluster take free ports"):
        ClusterConfig(storage=StorageConfig(port=5555))
    both = ClusterConfig(
        controller=ControllerConfig(keys="k.keys"), storage=StorageConfig(keys="k.keys")
    )
    assert both == ClusterConfig().with_settings(keys="k.keys")


def test_the_components_travel_whole_as_json() -> None:
    """What ``ProcessCluster`` hands a child on its command line, and what the child decodes."""
    config = ClusterConfig().with_settings(
        lease_timeout=5.0, storage_timeout=1.5, replicas=2, metrics_port=9400, max_rows=10,
        connect_timeout=3.0, heartbeat_interval=0.5, storage_max_bytes=1 << 20, keys="/k",
    )  # fmt: skip
    for part in (config.controller, config.storage):
        assert msgspec.json.decode(msgspec.json.encode(part), type=type(part)) == part
    with pytest.raises(msgspec.ValidationError, match="replicas must be 1 or 2"):
        msgspec.json.decode(b'{"replicas": 3}', type=ControllerConfig)


def test_the_launcher_has_a_flag_per_setting_and_a_flag_sets_it() -> None:
    parser = processes._parser()
    text = " ".join(parser.format_help().split())
    for s in cluster_settings().values():
        assert s.flag in text and s.env in text
    flags = ["--storage-units", "3", "--storage-max-bytes", "99", "--storage-timeout", "2"]
    flags += ["--connect-timeout", "4.5", "--keys", "k.keys", "--metrics-port", "9400"]
    args = parser.parse_args(flags)
    config = cluster_config(None, **{n: getattr(args, n) for n in cluster_settings()})
    assert config.storage_units == 3 and config.storage.max_bytes == 99
    assert config.controller.storage_timeout == 2.0 and config.storage.connect_timeout == 4.5
    assert config.controller.keys == config.storage.keys == "k.keys"
    assert config.controller.metrics_port == 9400
    assert config.controller.lease_timeout == ControllerConfig.lease_timeout  # not given


def test_every_deployment_takes_config_and_settings() -> None:
    for deploy in (embedded.init, processes.ProcessCluster):
        params = inspect.signature(deploy).parameters
        assert params["config"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["settings"].kind is inspect.Parameter.VAR_KEYWORD
    assert tqstream.ClusterConfig is ClusterConfig and "ClusterConfig" in tqstream.__all__


def test_the_deployment_page_lists_every_setting() -> None:
    page = (DOCS / "deployment.md").read_text()
    for s in cluster_settings().values():
        assert f"`{s.name}`" in page and f"`{s.flag}`" in page, s.name
    for old in DEPRECATED:
        assert f"`{old}`" in page


def test_the_client_coalesce_window_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqstream.config import ClientConfig, from_env

    assert from_env(ClientConfig).coalesce_window == 0.0
    monkeypatch.setenv("TQSTREAM_COALESCE_WINDOW", "0.002")
    assert from_env(ClientConfig).coalesce_window == 0.002
    monkeypatch.setenv("TQSTREAM_COALESCE_WINDOW", "None")  # never coalesce
    assert from_env(ClientConfig).coalesce_window is None
    monkeypatch.setenv("TQSTREAM_COALESCE_WINDOW", "-1")
    with pytest.raises(ConfigError, match="coalesce_window must be >= 0"):
        from_env(ClientConfig)
