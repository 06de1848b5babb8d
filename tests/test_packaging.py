"""What a wheel ships: every package folder of the source tree is in ``pyproject.toml``'s package list
(setuptools installs only the packages named there; an editable install hides a missing one, a wheel
does not — the no-UCX CI job installs a wheel)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    found = set()
    for top, name in (("kvbridge", "kvbridge"), ("connectors", "kvbridge.connectors")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing, stale = _source_packages() - listed, listed - _source_packages()
    assert not missing, f"package folders not in pyproject.toml's [tool.setuptools] packages: {sorted(missing)}"
    assert not stale, f"pyproject.toml lists packages with no folder: {sorted(stale)}"
