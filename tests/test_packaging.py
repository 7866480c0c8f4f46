"""What a wheel ships: every subpackage of fastfeed, not only the top level."""

from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_packaged():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packaged = set(find_packages(str(ROOT), include=include))
    on_disk = {".".join(init.parent.relative_to(ROOT).parts)
               for init in (ROOT / "fastfeed").rglob("__init__.py")}
    assert "fastfeed.ultralytics" in on_disk
    assert on_disk <= packaged, on_disk - packaged
    assert packaged <= on_disk, packaged - on_disk  # nothing else (tests, benchmarks) ships
