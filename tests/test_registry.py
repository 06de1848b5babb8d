import dataclasses
import subprocess
import sys
from typing import Literal

import pytest

import kvbridge
from kvbridge import registry
from kvbridge.cli import main
from kvbridge.errors import ConfigError, MissingDependency, UnknownBackend
from kvbridge.options import parse_options, require


def test_unknown_backend_lists_known_names():
    with pytest.raises(UnknownBackend, match="known:.*memory"):
        registry.get("nope")


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="'nmae'"):
        registry.create("memory", {"nmae": "x"})


def test_missing_extra_names_install_line(monkeypatch):
    monkeypatch.setitem(
        registry._BUILTIN, "ghost", registry.BackendSpec("ghost", "kvbridge_no_such_module", "x", extra="ghost")
    )
    with pytest.raises(MissingDependency, match=r"pip install 'kvbridge\[ghost\]'"):
        registry.get("ghost")


@dataclasses.dataclass(frozen=True)
class Opts:
    path: str
    capacity_bytes: int = 0
    fsync: bool = False
    mode: Literal["lru", "fifo"] = "lru"
    ratio: float = 1.0
    tiers: tuple[dict, ...] = ()

    def __post_init__(self):
        require(self.capacity_bytes >= 0, "capacity_bytes must be >= 0")


def test_options_parse_and_coerce():
    o = parse_options(Opts, {"path": "/x", "capacity_bytes": "1024", "fsync": "yes", "tiers": [{"backend": "cpu"}]})
    assert o == Opts("/x", 1024, True, "lru", 1.0, ({"backend": "cpu"},))
    with pytest.raises(ConfigError, match="missing required .*'path'"):
        parse_options(Opts, {})
    with pytest.raises(ConfigError, match="capacity_bytes"):
        parse_options(Opts, {"path": "/x", "capacity_bytes": "lots"})
    with pytest.raises(ConfigError, match="must be >= 0"):
        parse_options(Opts, {"path": "/x", "capacity_bytes": -1})
    with pytest.raises(ConfigError, match="one of"):
        parse_options(Opts, {"path": "/x", "mode": "random"})
    with pytest.raises(ConfigError, match="boolean"):
        parse_options(Opts, {"path": "/x", "fsync": "maybe"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.path = "y"  # type: ignore[misc]


def test_import_is_cheap_and_lazy():
    code = "import sys, kvbridge; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    assert kvbridge.KVLayout.__name__ == "KVLayout"
    with pytest.raises(AttributeError):
        kvbridge.nothing_here  # noqa: B018


def test_every_exported_name_resolves():
    """Each name ``kvbridge`` lists resolves to an attribute of the module it names (vLLM's connectors where
    vLLM is installed: without it they raise MissingDependency, which says how to get it)."""
    for name in kvbridge.__all__:
        try:
            getattr(kvbridge, name)
        except MissingDependency:
            assert name.endswith("Connector"), name


def test_cli_backends_and_version(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "memory" in out and "yes" in out
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert kvbridge.__version__ in capsys.readouterr().out


@pytest.mark.parametrize("options", ["demo", ["path", "/tmp"], 3, {1: "x"}])
def test_options_that_are_not_a_mapping_are_a_config_error(options):
    """Not a ValueError from dict(): the API raises only kvbridge errors for bad arguments."""
    with pytest.raises(kvbridge.ConfigError, match="option"):
        kvbridge.create_backend("memory", options)


@pytest.mark.parametrize("name", [None, 3, ("memory",)])
def test_a_backend_name_that_is_not_a_string_is_named(name):
    with pytest.raises(kvbridge.UnknownBackend, match="string"):
        kvbridge.create_backend(name, {})


def _directory_options(backend: str, folder: str) -> dict:
    return {"fs": {"path": folder}, "ucx": {"registry_dir": folder},
            "lmcache": {"local_disk": folder, "local_disk_bytes": 1 << 20}}[backend]


@pytest.mark.parametrize("backend", ["fs", "ucx", "lmcache"])
def test_a_directory_option_that_cannot_hold_files_is_refused_at_start_up(backend, tmp_path):
    """A regular file, a path under one, and /proc are refused when the backend is made, naming the
    option, instead of an engine that runs with a cache storing nothing (a log line per save)."""
    pytest.importorskip({"fs": "numpy", "ucx": "ucxx", "lmcache": "lmcache"}[backend])
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"not a folder")
    cases = {str(a_file): "not a directory", str(a_file / "under"): "not a directory",
             "/proc/kvbridge-cache": "not writable"}
    for folder, why in cases.items():
        with pytest.raises(ConfigError, match=f"option '.*': {folder} .*{why}"):
            kvbridge.create_backend(backend, _directory_options(backend, folder))
    assert a_file.read_bytes() == b"not a folder"  # refused, and nothing was touched


@pytest.mark.parametrize("backend", ["fs", "ucx"])
def test_a_missing_directory_is_made_at_start_up(backend, tmp_path):
    pytest.importorskip({"fs": "numpy", "ucx": "ucxx"}[backend])
    folder = tmp_path / "new" / "cache"
    kvbridge.create_backend(backend, _directory_options(backend, str(folder)))
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe file is gone
