"""One worker of the elastic job of tests/hvd/test_elastic_hvd.py: shrink from 2 workers to 1, grow back to 2.

Run by `horovodrun --min-np 1 --max-np 2 --host-discovery-script <script>`; the script prints the
content of `<workdir>/hosts`, which rank 0 rewrites itself at fixed points of training (so the test
needs no timing): after `SHRINK_AT` steps at 2 workers it writes `localhost:1` (Horovod removes
slot 1, the workers reset, training continues alone), after `GROW_AFTER` steps alone `localhost:2`
(Horovod starts a new worker, which joins at the next commit), and `FINISH_AFTER` steps after the
regrowth every rank writes its result: weights checksum, compression policy state, and the CF the
compression planned at every step since the regrowth.

argv: workdir, mode, policy ("gravac" or "dqsgd"). mode "state": `crossover.elastic.TorchState(..., compression=comp)`;
"callback": the formerly documented way (`hvd.elastic.TorchState` and a reset callback calling
`comp.reset(); comp.sync()`), which hangs when the worker joins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from hvd_harness import regression_step

from crossover.elastic import TorchState
from horovod_ext.torch_compression import AdaptiveCompression

log = logging.getLogger("hvd_elastic_worker")
SHRINK_AT, GROW_AFTER, FINISH_AFTER, MAX_STEPS = 8, 8, 12, 3000


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workdir, mode, policy = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128)  # 32768 weights: compressed; the bias goes dense
    if policy == "gravac":
        # window > the run: decisions depend on the summed gains only (deterministic), and the CF moves
        comp = AdaptiveCompression("topk", cf_min=4, cf_max=64, epsilon=0.9, window=10_000, ewma_alpha=0.3,
                                   min_compress_numel=1024)
    else:  # bits from the global gradient norm and the optimizer's learning rate
        comp = AdaptiveCompression(policy="dqsgd", total_steps=200, min_compress_numel=1024)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    if mode == "state":
        state = TorchState(model, opt, compression=comp, batch=0, sizes=[], phase_steps=0)
    else:
        state = hvd.elastic.TorchState(model, opt, batch=0, sizes=[], phase_steps=0)

        def on_reset() -> None:
            comp.reset()
            comp.sync()

        state.register_reset_callbacks([on_reset])
    cfs: dict[int, float] = {}

    def set_hosts(slots: int) -> None:
        tmp = workdir / "hosts.tmp"
        tmp.write_text(f"localhost:{slots}\n")
        os.replace(tmp, workdir / "hosts")
        log.info("rank 0: discovery now says localhost:%d (step %d)", slots, state.batch)

    @hvd.elastic.run
    def train(state: TorchState) -> dict:
        while state.batch < MAX_STEPS:
            size = hvd.size()
            if not state.sizes or state.sizes[-1] != size:  # identical on every rank (synced state)
                state.sizes = [*state.sizes, size]
                state.phase_steps = 0
            if state.sizes == [2, 1, 2] and state.phase_steps >= FINISH_AFTER:
                break
            regression_step(model, opt, state.batch)
            if state.sizes == [2, 1, 2]:
                stats = comp.stats()  # the CF (GraVAC) or bits (DQ-SGD) this step sent
                cfs[state.batch] = stats.get("bits", stats["compression_factor"])
            state.batch += 1
            state.phase_steps += 1
            if hvd.rank() == 0 and state.sizes == [2] and state.phase_steps == SHRINK_AT:
                set_hosts(1)
            if hvd.rank() == 0 and state.sizes == [2, 1] and state.phase_steps == GROW_AFTER:
                set_hosts(2)
            if state.sizes != [2, 1, 2]:
                time.sleep(0.05)  # leave Horovod's discovery (1 s) time to notice without racing ahead
            state.commit()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        policy = comp.state_dict()
        return {"rank": hvd.rank(), "size": hvd.size(), "batch": state.batch, "sizes": state.sizes,
                "weights": hashlib.sha256(flat.tobytes()).hexdigest(),
                "policy": json.dumps(policy["policy"], sort_keys=True), "step": policy["step"],
                "cfs": {str(k): v for k, v in sorted(cfs.items())}}

    result = train(state)
    out = Path(os.environ["CROSSOVER_RESULT_DIR"]) / f"rank{result['rank']}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
