"""crossover.tensorflow in real 2-rank horovod.tensorflow jobs (Gloo, CPU): `make test-tf`.

Skipped, with the reason, where TensorFlow or Horovod's TensorFlow ops are not importable (the
default `make test` environment); `make test-tf` sets up `.venv-tf` (WITH_TF=1) and runs them.
Job functions import TensorFlow inside, so collecting this file never needs it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hvd_harness import run_script

from crossover.compression.wire import SparseStatsLayout

WORKER = (Path(__file__).resolve().parents[1] / "hvd_tf_worker.py")
N = 50_000  # elements of the test variable (above min_compress_numel)
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def _tf_unavailable() -> str | None:
    """None when TensorFlow and horovod.tensorflow import here, else why not (checked in a subprocess)."""
    if importlib.util.find_spec("tensorflow") is None:
        return "TensorFlow is not installed in this environment (make test-tf sets up .venv-tf with it)"
    proc = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"], capture_output=True, text=True,
                          env={**os.environ, **QUIET}, timeout=300)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"horovod.tensorflow is not importable (Horovod built without TensorFlow?): {last}"
    return None


_SKIP = _tf_unavailable()
pytestmark = [pytest.mark.tensorflow, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]


def run_tf(fn, args=(), timeout: float = 300, env: dict[str, str] | None = None) -> list:
    """Run module-level `fn(*args)` on 2 horovod.tensorflow ranks; each rank's return value."""
    return run_script(WORKER, np=2, args=[__file__, fn.__name__, json.dumps(list(args))], timeout=timeout,
                      env={**QUIET, **(env or {})})


# ---------------------------------------------------------------------------------------------
# rank-side helpers
# ---------------------------------------------------------------------------------------------
def _rank_grad(step: int, heavy: bool = False) -> np.ndarray:
    import horovod.tensorflow as hvd

    rng = np.random.default_rng(1000 * hvd.rank() + step)
    g = rng.standard_normal(N).astype(np.float32)
    if heavy and hvd.rank() == 1:  # a different distribution on purpose: heavy tails, 100x scale
        g = (100 * rng.standard_normal(N) ** 3).astype(np.float32)
    return g


def _reduce_eager(compression, g: np.ndarray, **kw) -> np.ndarray:
    """One eager DistributedGradientTape step on loss = <w, g>: returns the reduced gradient."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    w = tf.Variable(tf.zeros([N]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * tf.constant(g))
    tape = hvd.DistributedGradientTape(tape, compression=compression, **kw)
    return tape.gradient(loss, [w])[0].numpy()


# ---------------------------------------------------------------------------------------------
# averages
# ---------------------------------------------------------------------------------------------
def averages_job():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression, FP16Compression, QSGDCompression, StaticCompression

    g = _rank_grad(0)
    out = {"local": g.tolist()}
    cases = {
        "none": (hvd.Compression.none, {}),
        "off": (AdaptiveCompression(enabled=False, min_compress_numel=1), {}),
        "fp16": (FP16Compression(), {}),
        "randomk": (StaticCompression("randomk", cf=4, error_feedback=False), {}),
        "topk": (StaticCompression("topk", cf=10, error_feedback=False), {}),
        "topk_sum": (StaticCompression("topk", cf=10, error_feedback=False), {"op": hvd.Sum}),
        "topk_groups": (StaticCompression("topk", cf=10, error_feedback=False), {"groups": 1}),
        "topk_predivide": (StaticCompression("topk", cf=10, error_feedback=False), {"gradient_predivide_factor": 2.0}),
        "topk_dense": (StaticCompression("topk", cf=1.5, error_feedback=False), {}),  # CF < world: dense
        "topk100": (StaticCompression("topk", cf=100, error_feedback=False), {}),
        "topk7": (StaticCompression("topk", cf=7, error_feedback=False), {}),  # an odd k: a padded last value row
        "qsgd_ag": (QSGDCompression(8, transport="allgather"), {}),
        "qsgd_ar": (QSGDCompression(8, transport="allreduce"), {}),
    }
    for name, (comp, kw) in cases.items():
        out[name] = _reduce_eager(comp, g, **kw).tolist()
        if hasattr(comp, "stats"):
            out[name + "_stats"] = {k: v for k, v in comp.stats().items()
                                          if not k.startswith("policy/")}
    # eager hvd.allreduce with the compression (no tf.function): two calls, two steps
    comp = StaticCompression("topk", cf=10, error_feedback=False)
    out["topk_eager"] = [hvd.allreduce(tf.constant(g), compression=comp).numpy().tolist() for _ in range(2)]
    out["topk_eager_step"] = comp.stats()["step"]
    return out


def _topk_local(g: np.ndarray, cf: float) -> np.ndarray:
    k = int(np.ceil(len(g) / cf))
    keep = np.argsort(-np.abs(g), kind="stable")[:k]
    out = np.zeros_like(g)
    out[keep] = g[keep]
    return out


def test_averages_match_horovod_and_compression_off_is_exact():
    res = run_tf(averages_job)
    g0, g1 = (np.asarray(r["local"], np.float32) for r in res)
    avg = (g0 + g1) / 2
    for r in res:
        none = np.asarray(r["none"], np.float32)
        np.testing.assert_allclose(none, avg, rtol=1e-6, atol=1e-6)
        assert np.array_equal(np.asarray(r["off"], np.float32), none), "compression off is Horovod's dense path"
        assert r["off_stats"]["bytes_sent"] == r["off_stats"]["bytes_dense"] == N * 4
        np.testing.assert_allclose(r["fp16"], avg, rtol=2e-3, atol=2e-3)
        assert r["fp16_stats"]["bytes_sent"] * 2 == r["fp16_stats"]["bytes_dense"]
        np.testing.assert_allclose(r["topk_dense"], avg, rtol=1e-6, atol=1e-6)
    for name in ("randomk", "topk", "topk_sum", "topk_groups", "topk_predivide", "topk_eager", "qsgd_ag", "qsgd_ar"):
        assert res[0][name] == res[1][name], f"{name}: ranks disagree"
    rk = np.asarray(res[0]["randomk"], np.float32)
    nz = rk != 0
    assert abs(int(nz.sum()) - N // 4) <= 2, "random-k at CF 4 keeps a quarter of the elements"
    np.testing.assert_allclose(rk[nz], avg[nz], rtol=1e-6, atol=1e-6)
    both = _topk_local(g0, 10) + _topk_local(g1, 10)  # each rank's exact top-k, summed
    np.testing.assert_allclose(res[0]["topk"], both / 2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res[0]["topk_sum"], both, rtol=1e-6, atol=1e-6)
    for name in ("topk_groups", "topk_predivide"):
        np.testing.assert_allclose(res[0][name], both / 2, rtol=1e-6, atol=1e-6)
    for reduced in res[0]["topk_eager"]:
        np.testing.assert_allclose(reduced, both / 2, rtol=1e-6, atol=1e-6)
    assert res[0]["topk_eager_step"] == 2
    k = int(np.ceil(N / 10))
    nstats = SparseStatsLayout(2, checks=False).length  # the statistics riding with the payload (floor, candidate)
    # k > N / 32: a bitmap (a bit per element, in rows of 64) and the values, not (index, value) pairs
    bitmap = -(-N // 64) * 8 + 8 * -(-k // 2)
    assert res[0]["topk_stats"]["bytes_sent"] == bitmap + nstats * 4 and res[0]["topk_stats"]["bytes_dense"] == N * 4
    assert bitmap < k * 8
    k100 = int(np.ceil(N / 100))  # k < N / 32: pairs
    both100 = _topk_local(g0, 100) + _topk_local(g1, 100)
    both7 = _topk_local(g0, 7) + _topk_local(g1, 7)
    for r in res:
        np.testing.assert_allclose(r["topk100"], both100 / 2, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r["topk7"], both7 / 2, rtol=1e-6, atol=1e-6)
        assert r["topk100_stats"]["bytes_sent"] == k100 * 8 + nstats * 4
    assert res[0]["randomk_stats"]["bytes_sent"] == (N // 4 + nstats) * 4
    scale = max(np.abs(g0).max(), np.abs(g1).max())
    qa, qr = (np.asarray(res[0][n], np.float32) for n in ("qsgd_ag", "qsgd_ar"))
    assert np.abs(qa - avg).max() <= scale / 127 + 1e-5, "each element: an average of two roundings"
    np.testing.assert_allclose(qr, qa, rtol=2e-3, atol=1e-3)  # same levels; fp16 rounding only
    assert res[0]["qsgd_ag_stats"]["bytes_sent"] < N * 4 / 3.9
    assert res[0]["qsgd_ar_stats"]["bytes_sent"] < N * 4 / 1.99


# ---------------------------------------------------------------------------------------------
# identical decisions when ranks differ
# ---------------------------------------------------------------------------------------------
def decisions_job(steps):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression

    comp = AdaptiveCompression("topk", cf_min=4, cf_max=256, epsilon=0.3, window=5, ewma_alpha=0.5)
    qcomp = AdaptiveCompression(policy="dqsgd", total_steps=steps, lr=0.1, target_bits=5, decay=0.97)
    w = tf.Variable(tf.zeros([N]))
    w2 = tf.Variable(tf.zeros([N]))
    gv = tf.Variable(tf.zeros([N]))

    @tf.function
    def step():
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(w * gv)
            loss2 = tf.reduce_sum(w2 * gv)
        g = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [w])[0]
        g2 = hvd.DistributedGradientTape(tape, compression=qcomp).gradient(loss2, [w2])[0]
        return g, g2

    cfs, bits, sums = [], [], []
    for t in range(steps):
        gv.assign(_rank_grad(t, heavy=True) * (1 + t / 10))
        g, g2 = step()
        cfs.append(comp.stats()["compression_factor"])
        bits.append(qcomp.stats()["bits"])
        sums.append(hashlib.sha256(g.numpy().tobytes() + g2.numpy().tobytes()).hexdigest())
    st = comp.stats()
    # a resumed object continues the same schedule; sync() makes every rank's policy rank 0's
    state = comp.state_dict()
    again = AdaptiveCompression("topk", cf_min=4, cf_max=256, epsilon=0.3, window=5, ewma_alpha=0.5)
    again.load_state_dict(state)
    assert again.policy.state_dict() == comp.policy.state_dict() and again.stats()["step"] == steps
    assert sorted(state["residuals"]) == ["#0"] and state["residuals"]["#0"].shape == (N,)
    again.sync()
    return {"cfs": cfs, "bits": bits, "sums": sums, "policy": repr(comp.policy),
            "bytes": [st["bytes_sent"], st["bytes_dense"]], "step": st["step"],
            "keys": sorted(k for k in st), "debug_keys": sorted(comp.stats(debug=True)),
            "qkeys": sorted(qcomp.stats())}


def test_identical_decisions_when_ranks_differ():
    steps = 40
    res = run_tf(decisions_job, args=[steps])
    a, b = res
    assert a["cfs"] == b["cfs"] and a["bits"] == b["bits"] and a["policy"] == b["policy"]
    assert a["sums"] == b["sums"], "every rank applies the same averaged gradient"
    assert len(set(a["cfs"])) >= 2, a["cfs"]
    assert len(set(a["bits"])) >= 2, a["bits"]
    assert a["step"] == steps
    assert a["bytes"][0] < a["bytes"][1]
    assert a["keys"] == sorted([
        "step", "compression_factor", "gain", "bytes_sent", "bytes_dense", "compressor", "nonfinite_steps",
        "settled", "settled_reason", "max_cf", "momentum"])
    assert {"policy/settled", "policy/send_cf", "policy/searches", "saturated_steps"} <= set(a["debug_keys"])
    assert {"step", "bits", "compression_factor", "gain", "bytes_sent", "bytes_dense"} <= set(a["qkeys"])


# ---------------------------------------------------------------------------------------------
# TensorBoard (tensorboard=): a directory, rank 0 writes
# ---------------------------------------------------------------------------------------------
def tensorboard_job(root, steps):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression

    comp = AdaptiveCompression("topk", cf_min=4, cf_max=64, window=4, tensorboard=os.path.join(root, "gravac"))
    qcomp = AdaptiveCompression(policy="dqsgd", total_steps=steps, lr=0.1, tensorboard=os.path.join(root, "dqsgd"))
    w, w2, gv = tf.Variable(tf.zeros([N])), tf.Variable(tf.zeros([N])), tf.Variable(tf.zeros([N]))

    @tf.function
    def step():
        with tf.GradientTape(persistent=True) as tape:
            loss, loss2 = tf.reduce_sum(w * gv), tf.reduce_sum(w2 * gv)
        g = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [w])[0]
        g2 = hvd.DistributedGradientTape(tape, compression=qcomp).gradient(loss2, [w2])[0]
        return g, g2

    for t in range(steps):
        gv.assign(_rank_grad(t))
        step()
    stats = comp.stats()
    return {"pid": os.getpid(), "rank": hvd.rank(),
            "scalar_values": all(v is None or isinstance(v, (int, float, str)) for v in stats.values())}


def test_tensorboard_directory_rank0_writes_one_value_per_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = 12
    res = run_tf(tensorboard_job, args=[str(tmp_path), steps])  # the ranks exit normally: flushed at exit
    every = list(range(1, steps + 1))
    for name, tag in (("gravac", "crossover/compression_factor"), ("dqsgd", "crossover/bits")):
        files = [n for n in os.listdir(tmp_path / name) if "tfevents" in n]
        assert len(files) == 1 and f".{res[0]['pid']}." in files[0], files  # rank 1 wrote nothing
        acc = EventAccumulator(str(tmp_path / name), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars(tag)] == every
        # the last step's bytes are still in the in-graph accumulator at exit: every step but the last
        assert [e.step for e in acc.Scalars("crossover/bytes_sent_over_dense")] == every[:-1]
        assert [e.step for e in acc.Scalars("crossover/step_time_s")] == every[:-1]
    assert all(r["scalar_values"] for r in res)


# ---------------------------------------------------------------------------------------------
# pass-through tensors, refused settings
# ---------------------------------------------------------------------------------------------
def passthrough_job():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression

    rng = np.random.default_rng(7)  # same start on both ranks
    emb = tf.Variable(rng.standard_normal((1000, 40)).astype(np.float32))  # gathered rows: IndexedSlices
    w64 = tf.Variable(rng.standard_normal(30000))  # float64: untouched
    bias = tf.Variable(np.zeros(10, np.float32))  # small: untouched
    ids = tf.constant(np.random.default_rng(hvd.rank()).integers(0, 1000, 64))
    out = {}
    for label, comp in (("dense", None), ("adaptive", AdaptiveCompression(cf_min=20, epsilon=0.1,
                                                                          min_compress_numel=16))):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, ids) ** 2) + tf.reduce_sum(tf.cast(w64, tf.float32) ** 2 * 0.5) \
                + tf.reduce_sum(bias * float(hvd.rank() + 1))
        kw = {} if comp is None else {"compression": comp}
        grads = hvd.DistributedGradientTape(tape, **kw).gradient(loss, [emb, w64, bias])
        out[label] = [isinstance(grads[0], tf.IndexedSlices), tf.convert_to_tensor(grads[0]).numpy().tolist()[:50],
                      grads[1].numpy().tolist(), grads[2].numpy().tolist(), grads[1].dtype.name]
    return out


def test_sparse_float64_and_small_gradients_pass_through():
    for r in run_tf(passthrough_job):
        assert r["dense"] == r["adaptive"]
        assert r["adaptive"][0] is True and r["adaptive"][4] == "float64"


def adasum_job():
    import horovod.tensorflow as hvd

    from crossover.tensorflow import StaticCompression

    try:
        _reduce_eager(StaticCompression("topk", cf=10), _rank_grad(0), op=hvd.Adasum)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_adasum_is_refused_clearly():
    for msg in run_tf(adasum_job):
        assert "Adasum" in msg and "hvd.Average" in msg


TF_CLASSES = ("AdaptiveCompression", "StaticCompression", "FP16Compression", "QSGDCompression", "DqsgdCompression")


def class_forms_job():
    """compression=<crossover class> (not an object): refused by the tape / optimizer constructors,
    and by `compress` itself where no constructor is in between (hvd.allreduce)."""
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    import tensorflow as tf

    import crossover
    import crossover.tensorflow as xt
    from horovod_ext import _dispatch

    classes = {f"crossover.tensorflow.{n}": getattr(xt, n) for n in TF_CLASSES}
    classes.update({f"crossover.{n}": getattr(crossover, n) for n in TF_CLASSES})
    classes.update({f"lazy.{n}": _dispatch.lazy_class(n) for n in TF_CLASSES})
    v = tf.Variable(np.ones(8, np.float32))
    out = {}
    for label, cls in classes.items():
        for where, build in (
            ("tape", lambda c: hvd.DistributedGradientTape(tf.GradientTape(), compression=c)),
            ("keras", lambda c: hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=c)),
            ("allreduce", lambda c: hvd.allreduce(v, compression=c)),
        ):
            try:
                build(cls)
                out[f"{label}/{where}"] = ["accepted"]
            except Exception as exc:  # noqa: BLE001 - the test reports what was raised
                out[f"{label}/{where}"] = [type(exc).__name__, isinstance(exc, TypeError), str(exc)]
    with tf.GradientTape() as tape:  # the instance form still works
        loss = tf.reduce_sum(v * float(hvd.rank() + 1))
    grads = hvd.DistributedGradientTape(tape, compression=xt.FP16Compression()).gradient(loss, [v])
    out["instance"] = [grads[0].numpy().tolist()]
    return out


def test_every_class_is_refused_when_the_tape_or_optimizer_is_built():
    res = run_tf(class_forms_job)
    assert res[0] == res[1]
    out = res[0]
    for label, value in out.items():
        if label == "instance":
            assert value == [[1.5] * 8]
            continue
        name = label.split("/")[0].rsplit(".", 1)[-1]
        assert value[0] == "CompressionClassError" and value[1], (label, value)
        assert f"compression={name}()" in value[2] and "one per optimizer" in value[2], (label, value)


def test_bad_settings_raise_at_construction():
    code = r"""
import json
from crossover.tensorflow import AdaptiveCompression, QSGDCompression, StaticCompression
bad = {
    "dgc": lambda: AdaptiveCompression("dgc"),
    "cf": lambda: StaticCompression(cf=0.5),
    "numel": lambda: AdaptiveCompression(min_compress_numel=0),
    "eps": lambda: AdaptiveCompression(epsilon=2.0),
    "policy": lambda: AdaptiveCompression(policy="nope"),
    "bits": lambda: QSGDCompression(9),
    "transport": lambda: QSGDCompression(4, transport="carrier pigeon"),
    "total": lambda: AdaptiveCompression(policy="dqsgd", lr=0.1),
    "lr": lambda: AdaptiveCompression(policy="dqsgd", total_steps=10),
}
out = {}
for name, make in bad.items():
    try:
        make()
        out[name] = "accepted"
    except ValueError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **QUIET}, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(v != "accepted" for v in out.values()), out
    assert "topk" in out["dgc"] and "learning rate" in out["lr"] and "total_steps" in out["total"]


def test_import_does_not_need_torch():
    code = ("import sys; import crossover.tensorflow as x\n"
            "assert 'torch' not in sys.modules, 'importing crossover.tensorflow imported torch'\n"
            "print(x.AdaptiveCompression.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **QUIET}, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("horovod_ext.tf_compression")


def test_same_import_as_torch_gives_the_tensorflow_objects():
    code = ("import sys; import horovod.tensorflow\n"
            "from crossover import AdaptiveCompression, QSGDCompression\n"
            "assert 'torch' not in sys.modules, 'from crossover import ... imported torch in a TF script'\n"
            "print(AdaptiveCompression.__module__, QSGDCompression.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **QUIET}, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["horovod_ext.tf_compression", "horovod_ext.tf_quantization"]


# ---------------------------------------------------------------------------------------------
# training: DistributedGradientTape on digits, and the Keras path
# ---------------------------------------------------------------------------------------------
def _digits(seed: int = 0):
    """scikit-learn's digits, scaled, split 80/20 with a fixed seed; this rank's equal-length shard."""
    import horovod.tensorflow as hvd
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    per = cut // hvd.size()
    shard = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
    return x[:cut][shard], y[:cut][shard], x[cut:], y[cut:]


def train_digits_tf(compression, epochs: int, seed: int = 0, hidden: int = 512, lr: float = 0.2,
                    batch: int = 32) -> dict:
    """The digits MLP of benchmarks/digits.py, in TensorFlow, with a DistributedGradientTape in a tf.function."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    xtr, ytr, xte, yte = _digits(seed)
    rng = np.random.default_rng(seed)
    shapes = [(64, hidden), (hidden,), (hidden, hidden), (hidden,), (hidden, 10), (10,)]
    params = [tf.Variable((rng.uniform(-1, 1, s) / np.sqrt(s[0]) if len(s) == 2 else np.zeros(s)).astype(np.float32))
              for s in shapes]
    hvd.broadcast_variables(params, root_rank=0)

    def forward(x):
        h = tf.nn.relu(x @ params[0] + params[1])
        h = tf.nn.relu(h @ params[2] + params[3])
        return h @ params[4] + params[5]

    kw = {} if compression is None else {"compression": compression}

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, forward(xb)))
        grads = hvd.DistributedGradientTape(tape, **kw).gradient(loss, params)
        for p, g in zip(params, grads):
            p.assign_sub(lr * g)
        return loss

    order_rng = np.random.default_rng(seed + 1)
    history, steps = [], 0
    for _ in range(epochs):
        order = order_rng.permutation(len(xtr))
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            step(tf.constant(xtr[idx]), tf.constant(ytr[idx]))
            steps += 1
        history.append(float(np.mean(np.argmax(forward(tf.constant(xte)).numpy(), 1) == yte)))
    dense_bytes = sum(int(np.prod(s)) * 4 for s in shapes) * steps
    stats = compression.stats() if hasattr(compression, "stats") else None
    return {"history": history, "last3": float(np.mean(history[-3:])), "dense_bytes": dense_bytes,
            "bytes_sent": stats["bytes_sent"] if stats else dense_bytes,
            "stats": {k: v for k, v in stats.items() if not k.startswith("policy/")} if stats else None,
            "weights": hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()}


def digits_job(epochs):
    from crossover.tensorflow import AdaptiveCompression

    dense = train_digits_tf(None, epochs)
    # The paper search decides on gains alone, so it compresses on loopback too; the default ladder decides
    # by step time, and on loopback dense is a fair choice (tests/hvd/test_defaults_hvd.py covers the defaults).
    adaptive = train_digits_tf(AdaptiveCompression("topk", search="paper", gain="norm", cf_min=30, cf_max=1000,
                                                   epsilon=0.15, window=100, min_compress_numel=4096), epochs)
    return {"dense": dense, "adaptive": adaptive}


@pytest.mark.timeout(960)
def test_digits_training_close_to_dense_with_fewer_bytes():
    res = run_tf(digits_job, args=[20], timeout=900)
    for r in res:
        d, a = r["dense"], r["adaptive"]
        assert d["last3"] > 0.9, d["history"]
        assert a["last3"] >= d["last3"] - 0.01, (d["history"], a["history"])
        assert a["bytes_sent"] * 3 < a["dense_bytes"], a["stats"]
        assert a["stats"]["bytes_dense"] == a["dense_bytes"]
    assert res[0]["dense"]["weights"] == res[1]["dense"]["weights"]
    assert res[0]["adaptive"]["weights"] == res[1]["adaptive"]["weights"]


def keras_job(epochs):
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression

    assert tf.keras.Model.__module__.startswith("tf_keras"), "needs TF_USE_LEGACY_KERAS=1 with tf-keras"
    keras = tf.keras
    xtr, ytr, xte, yte = _digits()
    keras.utils.set_random_seed(100 + hvd.rank())  # different initial weights on purpose: broadcast fixes them
    model = keras.Sequential([keras.layers.Dense(256, activation="relu", input_shape=(64,)),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    # gains alone decide (as in digits_job): the bytes check below must not depend on loopback timing
    comp = AdaptiveCompression("topk", search="paper", gain="norm", cf_min=30, cf_max=1000, epsilon=0.15,
                               window=50, min_compress_numel=4096)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comp)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(xtr, ytr, batch_size=32, epochs=epochs, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    acc = float(model.evaluate(xte, yte, verbose=0)[1])
    st = comp.stats()
    return {"weights": hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest(),
            "acc": acc, "bytes": [st["bytes_sent"], st["bytes_dense"]], "step": st["step"]}


def test_keras_path_trains_with_synchronized_weights():
    res = run_tf(keras_job, args=[8], timeout=600, env={"TF_USE_LEGACY_KERAS": "1"})
    assert res[0]["weights"] == res[1]["weights"], "weights differ across ranks after training"
    for r in res:
        assert r["acc"] > 0.85, r
        assert r["step"] >= 8 * 22 and 0 < r["bytes"][0] < r["bytes"][1] / 3, r


def test_keras3_optimizer_is_refused_clearly():
    code = r"""
import os
os.environ.pop("TF_USE_LEGACY_KERAS", None)
import keras
import crossover.tensorflow as xt
import horovod.tensorflow.keras as hvd
try:
    hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=xt.AdaptiveCompression())
    print("ACCEPTED")
except xt.KerasVersionError as exc:
    print("REFUSED", exc)
"""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, **QUIET}, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "TF_USE_LEGACY_KERAS=1" in proc.stdout and "tf-keras" in proc.stdout


def keras_momentum_job():
    """Horovod's Keras DistributedOptimizer shows our object its optimizer: the momentum each reports, unset or told,
    and the cap and CFs of two short trainings (plain SGD, SGD momentum 0.9) with the defaults."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression

    keras = tf.keras
    out = {}
    for label, make, told in (("sgd", lambda: keras.optimizers.SGD(0.1), None),
                              ("sgd_momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9), None),
                              ("adam", lambda: keras.optimizers.Adam(1e-3), None),
                              ("told", lambda: keras.optimizers.SGD(0.1, momentum=0.9), 0.0)):
        comp = AdaptiveCompression(min_compress_numel=1024, **({} if told is None else {"momentum": told}))
        hvd.DistributedOptimizer(make(), compression=comp)
        out[label] = comp.momentum
    xtr, ytr, _, _ = _digits()
    for label, momentum in (("fit_sgd", 0.0), ("fit_sgd_momentum", 0.9)):
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(64,)), keras.layers.Dense(10)])
        comp = AdaptiveCompression(min_compress_numel=1024)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=momentum), compression=comp)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(xtr[:640], ytr[:640], batch_size=32, epochs=2, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        st = comp.stats()
        out[label] = {"max_cf": st["max_cf"], "momentum": st["momentum"], "step": st["step"]}
    return out


def test_keras_reads_the_optimizer_momentum_as_the_torch_objects_do():
    # The torch objects read the wrapped optimizer's momentum (or Adam's beta1); a tape cannot, but Horovod's Keras
    # DistributedOptimizer shows the compression object its optimizer, so a plain-SGD Keras user gets the whole ladder
    # with no setting, and momentum 0.9 or Adam the cap at CF 10; `momentum=` still wins
    r0, r1 = run_tf(keras_momentum_job, timeout=600, env={"TF_USE_LEGACY_KERAS": "1"})
    assert r0 == r1
    assert r0["sgd"] == 0.0 and r0["sgd_momentum"] == pytest.approx(0.9) and r0["adam"] == pytest.approx(0.9)
    assert r0["told"] == 0.0
    plain, heavy = r0["fit_sgd"], r0["fit_sgd_momentum"]
    assert plain["step"] >= 30 and heavy["step"] >= 30, r0
    assert plain["momentum"] == 0.0 and plain["max_cf"] == 100.0, plain
    assert heavy["momentum"] == pytest.approx(0.9) and heavy["max_cf"] == 10.0, heavy


def momentum_default_job():
    """The defaults, told nothing and told momentum=0: what cap each ends with, and the CF sent on each step."""
    from crossover.tensorflow import AdaptiveCompression

    out = {}
    for label, comp in (("unset", AdaptiveCompression(min_compress_numel=1024)),
                        ("plain_sgd", AdaptiveCompression(min_compress_numel=1024, momentum=0))):
        cfs = []
        for step in range(20):
            _reduce_eager(comp, _rank_grad(step))
            cfs.append(float(comp.stats()["compression_factor"]))
        st = comp.stats()
        out[label] = {"max_cf": st["max_cf"], "momentum": st["momentum"], "cfs": cfs}
    return out


def test_a_tape_told_nothing_assumes_momentum_0_9_and_momentum_0_lifts_the_cap():
    # A tape does not see the optimizer: unset, the TF object reports UNKNOWN_MOMENTUM (0.9) and the same policy code
    # as the torch object caps the CF at 10 from the first step; momentum=0 gives the whole ladder (CF 100).
    r0, r1 = run_tf(momentum_default_job)
    assert r0 == r1
    assert r0["unset"]["max_cf"] == 10.0 and r0["unset"]["momentum"] == pytest.approx(0.9)
    cfs = r0["unset"]["cfs"]  # read after each step (the first reading says 1.0: nothing compressed before it)
    assert max(cfs) == 10.0, cfs
    assert r0["plain_sgd"]["max_cf"] == 100.0 and r0["plain_sgd"]["momentum"] == 0.0
