"""A horovod.torch script that imports crossover and builds its object before torch and Horovod
(tests/hvd/test_import_order_hvd.py): the object decides the framework at its first compress.

Trains the same model twice on every rank, once with that "early" object and once with one built
after `import horovod.torch` ("late", the horovod.torch class itself), and reports both runs.
"""

import sys

from crossover import AdaptiveCompression  # nothing of torch, TensorFlow or Horovod imported yet


def make():
    # window > the run: decisions depend on the summed gains only (deterministic), and the CF moves
    return AdaptiveCompression("topk", cf_min=4, cf_max=64, epsilon=0.9, window=10_000, ewma_alpha=0.3,
                               min_compress_numel=1024)


early = make()
built_before = type(early).__module__

import hashlib  # noqa: E402 - the import order is what this script tests

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from hvd_harness import regression_step, write_result  # noqa: E402


def train(comp) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    cfs = []
    for step in range(20):
        regression_step(model, opt, step)
        cfs.append(comp.stats()["compression_factor"])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {"cfs": cfs, "weights": hashlib.sha256(flat.tobytes()).hexdigest(),
            "residual_keys": sorted(comp.state_dict()["residuals"])}


def main() -> None:
    hvd.init()
    late = make()
    out = {"built_before": built_before, "late_module": type(late).__module__,
           "early": train(early), "late": train(late)}
    out["early_impl"] = type(early.__dict__["_impl"]).__module__
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    write_result(out)


if __name__ == "__main__":
    main()
