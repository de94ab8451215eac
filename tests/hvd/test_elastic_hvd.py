"""A real `hvd.elastic.run` job with crossover compression: 2 workers, shrink to 1, grow back to 2.

`horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script` on localhost with Gloo; the worker
(tests/hvd_elastic_worker.py) rewrites the discovery file itself at fixed training steps, so nothing
here depends on timing but the overall timeout, which turns a hang into a failure with all output.
The compression's state rides `crossover.elastic.TorchState` (docs/compression.md, "Elastic").
GraVAC runs in the default suite (about 30 s alone, 55 s on 2 busy cores); the same job with DQ-SGD is
marked `slow` (`make test-all`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hvd_harness import REPO, HorovodJobError, horovodrun_bin, regression_step, run_function

from crossover import procgroup

WORKER = (Path(__file__).resolve().parents[1] / "hvd_elastic_worker.py")


def run_elastic(tmp_path: Path, mode: str, policy: str, timeout: float) -> tuple[list[dict], str]:
    """Run the elastic job; (each final rank's result, all output). Raises HorovodJobError on failure/hang."""
    (tmp_path / "hosts").write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat '{tmp_path / 'hosts'}'\n")
    discover.chmod(0o755)
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "CROSSOVER_RESULT_DIR": str(results), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [horovodrun_bin(), "-np", "2", "--min-np", "1", "--max-np", "2", "--gloo",
           "--host-discovery-script", str(discover), "--network-interface", "lo", "--elastic-timeout", "60",
           sys.executable, str(WORKER), str(tmp_path), mode, policy]
    try:
        res = procgroup.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise HorovodJobError(f"elastic job hung: killed after {timeout:.0f} s.\ncommand: {' '.join(cmd)}\n"
                              f"--- output of all workers ---\n{exc.output or ''}") from exc
    if res.returncode != 0:
        raise HorovodJobError(f"elastic job failed with exit code {res.returncode}.\ncommand: {' '.join(cmd)}\n"
                              f"--- output of all workers ---\n{res.stdout}")
    out = []
    for rank in range(2):
        path = results / f"rank{rank}.json"
        if not path.exists():
            raise HorovodJobError(f"rank {rank} reported no result.\n--- output ---\n{res.stdout}")
        out.append(json.loads(path.read_text()))
    return out, res.stdout


@pytest.mark.parametrize("policy", ["gravac", pytest.param("dqsgd", marks=pytest.mark.slow)])
def test_elastic_shrink_to_one_and_grow_back_keeps_ranks_identical(tmp_path, policy):
    res, output = run_elastic(tmp_path, "state", policy, timeout=150)
    for r in res:
        assert r["sizes"] == [2, 1, 2], (r, output[-4000:])
        assert r["size"] == 2
    r0, r1 = res
    assert r0["batch"] == r1["batch"]
    assert r0["weights"] == r1["weights"], "every rank must end with the same weights"
    assert r0["policy"] == r1["policy"], "every rank must end with the same compression policy state"
    assert r0["step"] == r1["step"]
    # the new worker planned the same CF (GraVAC) or bits (DQ-SGD) as rank 0 at every step after it joined
    assert r0["cfs"] == r1["cfs"] and len(r0["cfs"]) >= 10, (r0["cfs"], r1["cfs"])
    assert max(r0["cfs"].values()) > 1, "compression must be on after the regrowth for the check to bite"


def commit_restore_sync_job():
    import hashlib

    import horovod.torch as hvd
    import torch

    from crossover.elastic import TorchState
    from horovod_ext.torch_compression import AdaptiveCompression

    def make():
        return AdaptiveCompression("topk", cf_min=4, cf_max=64, epsilon=0.9, window=10_000, ewma_alpha=0.3,
                                   min_compress_numel=1024)

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128)
    comp = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    state = TorchState(model, opt, compression=comp, batch=0)

    def snapshot():
        sd = comp.state_dict()
        res = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in sd.pop("residuals").items()}
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        return {"policy": json.dumps(sd["policy"], sort_keys=True), "step": sd["step"], "residuals": res,
                "weights": hashlib.sha256(weights.tobytes()).hexdigest()}

    for i in range(12):
        regression_step(model, opt, i)
    state.commit()
    committed = snapshot()
    for i in range(12, 20):
        regression_step(model, opt, i)
    moved = snapshot()
    state.restore()
    restored = snapshot()
    if hvd.rank() == 1:  # a worker that knows nothing: a fresh object, as a joining worker has
        state.compression = make()
    state.sync()
    synced = state.compression.state_dict(include_residuals=False)
    return {"committed": committed, "moved": moved, "restored": restored,
            "synced": json.dumps(synced["policy"], sort_keys=True), "synced_step": synced["step"]}


def test_commit_restore_and_sync_carry_the_compression_with_the_model():
    res = run_function(commit_restore_sync_job, timeout=120)
    for r in res:
        assert r["moved"]["step"] > r["committed"]["step"]
        assert r["restored"] == r["committed"], "restore() must roll the compression back with the model"
    assert res[1]["synced"] == res[0]["synced"] == res[0]["committed"]["policy"]
    assert res[1]["synced_step"] == res[0]["synced_step"] == res[0]["committed"]["step"]
