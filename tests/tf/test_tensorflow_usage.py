"""How users write horovod.tensorflow scripts, in real 2-rank jobs (`make test-tf`, marker `tensorflow`).

* The compression object built inside a `tf.function`, as Horovod's TF2 example does with
  `hvd.Compression.fp16`: crossover's FP16Compression works there; the stateful objects refuse with a
  message that says to build them once, outside (not TensorFlow's "only supports singleton tf.Variables").
* `from crossover import AdaptiveCompression` written before `import horovod.tensorflow` (and an object
  built before it): the framework is decided at first use, never torch in a TensorFlow script
  (tests/hvd_tf_import_order.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hvd_harness import run_script
from test_tensorflow_hvd import _SKIP, QUIET, WORKER

pytestmark = [pytest.mark.tensorflow, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]
N = 50_000


def run_tf(fn, args=(), timeout: float = 300) -> list:
    """Run module-level `fn(*args)` of this file on 2 horovod.tensorflow ranks; each rank's return value."""
    return run_script(WORKER, np=2, args=[__file__, fn.__name__, json.dumps(list(args))], timeout=timeout,
                      env=QUIET)


def _grads(step: int) -> np.ndarray:
    import horovod.tensorflow as hvd

    return np.stack([np.random.default_rng(1000 * r + step).standard_normal(N).astype(np.float32)
                     for r in range(hvd.size())])


def built_inside_function_job():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from crossover.tensorflow import AdaptiveCompression, FP16Compression, StaticCompression

    w = tf.Variable(tf.zeros([N]))
    made = []

    @tf.function
    def fp16_step(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * g)
        comp = FP16Compression()  # as Horovod's TF2 example builds hvd.Compression.fp16 in its step
        made.append(comp)
        return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [w])[0]

    errors = []
    for step in range(3):
        g = _grads(step)
        out = fp16_step(tf.constant(g[hvd.rank()])).numpy()
        errors.append(float(np.max(np.abs(out - g.mean(0)))))
    refusals = {}
    for name, make in (("adaptive", lambda: AdaptiveCompression("topk", cf_min=4)),
                       ("dqsgd", lambda: AdaptiveCompression(policy="dqsgd", total_steps=10, lr=0.1)),
                       ("static", lambda: StaticCompression("topk", cf=10))):
        @tf.function
        def stateful_step(g, make=make):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * g)
            return hvd.DistributedGradientTape(tape, compression=make()).gradient(loss, [w])[0]

        try:
            stateful_step(tf.constant(_grads(0)[hvd.rank()]))
            refusals[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the test reports whatever was raised
            refusals[name] = f"{type(exc).__name__}: {exc}"
    return {"errors": errors, "stats": made[-1].stats(), "refusals": refusals}


def test_fp16_built_inside_tf_function_works_and_stateful_objects_say_build_outside():
    for r in run_tf(built_inside_function_job):
        assert max(r["errors"]) < 5e-3, r["errors"]  # fp16 rounding of the average of 2 N(0,1) gradients
        # counted: 3 steps of N float32 elements, sent as fp16
        assert r["stats"]["bytes_dense"] == 3 * N * 4 and r["stats"]["bytes_sent"] == 3 * N * 2, r["stats"]
        for name, msg in r["refusals"].items():
            assert "created inside a tf.function" in msg and "outside the tf.function" in msg, (name, msg)
            assert "singleton" not in msg.split("(")[0], msg


def test_crossover_imported_before_horovod_tensorflow_gives_the_tensorflow_objects():
    res = run_script((Path(__file__).resolve().parents[1] / "hvd_tf_import_order.py"), np=2, timeout=300, env=QUIET)
    for r in res:
        assert not r["torch_imported"], "a TensorFlow script must not import torch"
        assert r["modules"] == {"early": "horovod_ext.tf_compression", "late": "horovod_ext.tf_compression",
                                "qsgd": "horovod_ext.tf_quantization"}, r["modules"]
        # fp16: rounding of values ~N(0, 1); QSGD 8 bits: one level of max|g| / 127 (about 0.04); sparse: finite
        tolerance = {"fp16": 5e-3, "qsgd": 0.1, "late": 0.5, "early": 0.5}
        for name, err in r["errors"].items():
            assert err < tolerance[name.split("_")[0]], (name, r["errors"])
        assert r["early_stats"]["bytes_dense"] > 0
    assert res[0]["early_cfs"] == res[1]["early_cfs"]


def bad_settings_job():
    """Issue 27: every setting of the TF objects checked at construction, with no coercion."""
    from crossover.tensorflow import AdaptiveCompression, GravacCompression, QSGDCompression, StaticCompression

    makers = {
        "AdaptiveCompression": lambda **kw: AdaptiveCompression("topk", **kw),
        "GravacCompression": lambda **kw: GravacCompression("randomk", **kw),
        "StaticCompression": lambda **kw: StaticCompression("randomk", **kw),
        "AdaptiveCompression(dqsgd)": lambda **kw: AdaptiveCompression(policy="dqsgd", total_steps=10, lr=0.1, **kw),
        "QSGDCompression": lambda **kw: QSGDCompression(4, **kw),
    }
    bad = [("enabled", "False"), ("error_feedback", "False"), ("seed", 1.5), ("seed", "0"), ("seed", 2 ** 70),
           ("log_csv", 123), ("log_csv", "{foo}.csv")]
    out = {}
    for what, make in makers.items():
        for name, value in bad:
            try:
                make(**{name: value})
                out[f"{what} {name}={value!r}"] = "accepted"
            except TypeError:
                continue  # the object has no such setting
            except ValueError as exc:
                out[f"{what} {name}={value!r}"] = str(exc)
    return out


def test_tf_settings_are_not_coerced():
    """`enabled="False"`, `error_feedback="False"`, a float, str or 70-bit seed, `log_csv=123` or a pattern with
    another placeholder than {rank}: ValueError naming the setting, at construction (as with horovod.torch)."""
    for r in run_tf(bad_settings_job):
        assert len(r) >= 20, r
        for case, msg in r.items():
            assert case.split()[-1].split("=")[0] in msg, (case, msg)


def bad_state_job():
    """Issue 27: a bad saved state is refused whole by the TF objects (ValueError, nothing changed)."""
    import numpy as np

    from crossover.tensorflow import QSGDCompression, StaticCompression

    out = {}
    for name, comp in (("static", StaticCompression("topk", cf=4)), ("qsgd", QSGDCompression(4))):
        good = comp.state_dict()
        good["residuals"] = {"#0": np.ones(8, np.float32)}
        comp.load_state_dict(good)
        before = comp.state_dict()
        bad = {"nan residual": {**good, "residuals": {"#0": np.full(8, np.nan, np.float32)}},
               "str residual": {**good, "residuals": {"#0": "abc"}},
               "residuals a list": {**good, "residuals": [np.ones(8)]},
               "None": None,
               "missing step": {k: v for k, v in good.items() if k != "step"},
               "negative step, good residuals": {**good, "step": -1}}
        for what, state in bad.items():
            try:
                comp.load_state_dict(state)
                out[f"{name} {what}"] = "accepted"
            except ValueError as exc:
                after = comp.state_dict()
                same = {k: v for k, v in after.items() if k != "residuals"} == \
                    {k: v for k, v in before.items() if k != "residuals"}
                same = same and all(np.array_equal(after["residuals"][k], before["residuals"][k])
                                    for k in before["residuals"])
                out[f"{name} {what}"] = "unchanged" if same else f"changed: {exc}"
    return out


def test_tf_bad_states_refused_and_change_nothing():
    for r in run_tf(bad_state_job):
        assert r and all(v == "unchanged" for v in r.values()), r
