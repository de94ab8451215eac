"""Construction errors, pass-through of tensors that must not be compressed, the cost model."""

import pytest
import torch

from crossover import AdaptiveCompression, StaticCompression
from crossover.compression.cost_model import ALLGATHER, ALLREDUCE, DENSE
from crossover.driver.transport import choose_transport


@pytest.mark.parametrize("kwargs, match", [
    ({"cf_min": 0.5}, "cf_min"),
    ({"cf_min": 100, "cf_max": 10}, "cf_min must be <= cf_max"),
    ({"epsilon": 0.0}, r"epsilon must be in \(0, 1\]"),
    ({"epsilon": 1.5}, "epsilon"),
    ({"omega": 1.0}, "omega"),
    ({"window": 0}, "window"),
    ({"scaling": "linear"}, "scaling"),
    ({"compressor": "nope"}, "compressor must be one of"),
    ({"min_compress_numel": 0}, "min_compress_numel"),
    ({"policy": "other"}, "policy"),
])
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveCompression(**kwargs)


@pytest.mark.parametrize("cf", [0, 0.5, float("nan"), "10"])
def test_static_bad_cf(cf):
    with pytest.raises(ValueError, match="cf"):
        StaticCompression("topk", cf=cf)


@pytest.mark.parametrize("tensor", [
    torch.arange(100_000, dtype=torch.int64),
    torch.ones(100_000, dtype=torch.int32),
    torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.tensor([1.0, 2.0]), (100_000,)),
    torch.ones(10),  # small
    torch.randn(100_000),  # large float32: compressed inside an optimizer's step, not outside one
])
def test_outside_an_optimizer_every_tensor_passes_through_exactly(tensor):
    comp = AdaptiveCompression()
    out, ctx = comp.compress(tensor)
    assert out is tensor
    assert comp.decompress(out, ctx) is tensor
    assert comp.stats()["bytes_dense"] == 0  # not the optimizer's gradients: not counted


def test_cost_model():
    assert choose_transport(1000, 1000, 2, False) == DENSE
    assert choose_transport(1000, 10, 2, True) == ALLREDUCE
    assert choose_transport(1000, 10, 2, False) == ALLGATHER
    # 8 ranks, 20% density: allgather of 8-byte pairs would send more than a dense allreduce
    assert choose_transport(1000, 200, 8, False) == DENSE
    with pytest.raises(ValueError):
        choose_transport(0, 1, 2, False)


def test_import_is_cheap_and_silent():
    import subprocess
    import sys

    code = "import sys, crossover; print(sorted(m for m in ('horovod', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]" and out.stderr == ""
