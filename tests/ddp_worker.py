"""Rank-side entry of ddp_harness.run_ddp: join the process group (Gloo; NCCL with CROSSOVER_DDP_BACKEND=nccl,
one GPU per rank), call the function, write its result."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    path, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    spec = importlib.util.spec_from_file_location("_xo_ddp_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    backend = os.environ.get("CROSSOVER_DDP_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = getattr(module, name)(*args)
        out = Path(os.environ["CROSSOVER_RESULT_DIR"]) / f"rank{dist.get_rank()}.json"
        out.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
