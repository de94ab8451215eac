"""Rank-side entry of ddp_harness.run_ddp: join the process group (Gloo; NCCL with CROSSOVER_DDP_BACKEND=nccl,
one GPU per rank), call the function, write its result."""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hvd_harness import load_test_module


def main() -> None:
    path, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    module = load_test_module(path, "_xo_ddp_test_module")
    torch.set_num_threads(1)
    backend = os.environ.get("CROSSOVER_DDP_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = getattr(module, name)(*args)
        out = Path(os.environ["CROSSOVER_RESULT_DIR"]) / f"rank{dist.get_rank()}.json"
        out.write_text(json.dumps(result))
        gc.collect()  # the job's DDP objects and their pending work go before the group does
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch 2.13 + Gloo: even a plain DDP job (no hook) aborts now and then while the interpreter shuts
    # down ("terminate called without an active exception", no Python frame); the work is done and the
    # result written, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
