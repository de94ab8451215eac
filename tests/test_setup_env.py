"""The environment `make setup` builds: Horovod's and crossover's declared requirements are installed
(what `pip check` reports for them), and tensorboard is there for the TensorBoard output.

Only these two distributions are checked, so that an unrelated package of a user's own environment
cannot fail the test; `scripts/setup.sh` runs the full `pip check` and warns.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.version import Version


def _missing(dist: str) -> list[str]:
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed as a distribution here")
    missing = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra, or another Python version
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{dist} requires {req}, which is not installed")
            continue
        if req.specifier and not req.specifier.contains(Version(installed), prereleases=True):
            missing.append(f"{dist} requires {req}, but {req.name} {installed} is installed")
    return missing


@pytest.mark.parametrize("dist", ["horovod", "crossover"])
def test_declared_requirements_are_installed(dist: str) -> None:
    assert not _missing(dist), "\n".join(_missing(dist)) + "\n(run make setup)"


def test_tensorboard_is_installed() -> None:
    assert importlib.util.find_spec("tensorboard") is not None, "tensorboard is missing (run make setup)"
