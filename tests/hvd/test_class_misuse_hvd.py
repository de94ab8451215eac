"""`compression=AdaptiveCompression` (the class, as Horovod users write `hvd.Compression.fp16`) fails early.

Real 2-rank horovod.torch jobs: every crossover compression class given to `hvd.DistributedOptimizer`
is refused when the optimizer is built, with a message naming `Name()`; where the constructor was
bound before crossover's glue (no guard), the first backward raises the same message, not an
AttributeError. The instance form keeps working. TensorFlow: tests/tf/test_tensorflow_hvd.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from hvd_harness import run_function

TORCH_CLASSES = ("AdaptiveCompression", "StaticCompression", "FP16Compression", "QSGDCompression",
                 "DqsgdCompression")


def _classes() -> dict[str, type]:
    """Every crossover class a horovod.torch user can reach, by how they reach it."""
    import crossover
    from horovod_ext import _dispatch, torch_compression, torch_quantization

    out = {f"crossover.{n}": getattr(crossover, n) for n in TORCH_CLASSES}
    out["torch_compression.GravacCompression"] = torch_compression.GravacCompression
    out["torch_quantization.QSGDCompression"] = torch_quantization.QSGDCompression
    out.update({f"lazy.{n}": _dispatch.lazy_class(n) for n in TORCH_CLASSES})
    return out


def _model_opt(compression=None, construct=None):
    import horovod.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.ReLU(), torch.nn.Linear(100, 4))
    build = construct or hvd.DistributedOptimizer
    kw = {} if compression is None else {"compression": compression}
    opt = build(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), **kw)
    return model, opt


def _train(model, opt, steps=3):
    import horovod.torch as hvd

    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        x, y = torch.randn(16, 200, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _error(exc: BaseException) -> list:
    return [type(exc).__name__, isinstance(exc, TypeError), str(exc)]


def class_forms_job():
    import horovod.torch as hvd

    from crossover import AdaptiveCompression

    out: dict[str, list] = {}
    for label, cls in _classes().items():
        try:
            _model_opt(cls)
            out[label] = ["accepted"]
        except Exception as exc:  # noqa: BLE001 - the test reports what was raised
            out[label] = _error(exc)
    try:  # positional, as in hvd.DistributedOptimizer(opt, named_parameters, compression)
        hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), None,
                                 AdaptiveCompression)
        out["positional"] = ["accepted"]
    except Exception as exc:  # noqa: BLE001
        out["positional"] = _error(exc)
    # No guard (Horovod's function taken before crossover's glue was imported): the first backward says it.
    unguarded = getattr(hvd.DistributedOptimizer, "__wrapped__", hvd.DistributedOptimizer)
    model, opt = _model_opt(AdaptiveCompression, construct=unguarded)
    out["unguarded_built"] = ["built"]
    try:
        _train(model, opt, steps=1)
        out["unguarded_backward"] = ["trained"]
    except Exception as exc:  # noqa: BLE001
        out["unguarded_backward"] = _error(exc)
    # Horovod's own classes still pass through the guard, and the instance form trains.
    _train(*_model_opt(hvd.Compression.fp16), steps=1)
    params = _train(*_model_opt(AdaptiveCompression(min_compress_numel=1)))
    out["instance_form"] = [[round(float(p.sum()), 6) for p in params]]
    return out


def test_every_class_is_refused_when_the_optimizer_is_built():
    res = run_function(class_forms_job, timeout=180)
    assert res[0] == res[1]
    out = res[0]
    expected = {"positional", *_classes_labels()}
    for label in expected:
        assert out[label][0] == "CompressionClassError", (label, out[label])
        kind, is_type_error, msg = out[label]
        name = label.rsplit(".", 1)[-1] if label != "positional" else "AdaptiveCompression"
        assert kind == "CompressionClassError" and is_type_error, (label, out[label])
        assert f"compression={name}()" in msg and "one per optimizer" in msg, (label, msg)
    assert out["unguarded_built"] == ["built"]
    assert out["unguarded_backward"][0] == "CompressionClassError", out["unguarded_backward"]
    kind, is_type_error, msg = out["unguarded_backward"]
    assert kind == "CompressionClassError" and is_type_error, out["unguarded_backward"]
    assert "compression=AdaptiveCompression()" in msg
    assert len(out["instance_form"][0]) == 4


def _classes_labels() -> list[str]:
    return ([f"crossover.{n}" for n in TORCH_CLASSES] + [f"lazy.{n}" for n in TORCH_CLASSES]
            + ["torch_compression.GravacCompression", "torch_quantization.QSGDCompression"])


# ---------------------------------------------------------------------------------------------
# unit: the guard and the metaclass (no Horovod job)
# ---------------------------------------------------------------------------------------------
def test_guard_binds_compression_by_position_and_keyword_and_passes_other_values():
    from horovod_ext._class_guard import CompressionClassError, CompressionType, guard_constructors

    class Mine(metaclass=CompressionType):
        def compress(self, tensor):
            return tensor, None

    calls = []

    def build(optimizer, named_parameters=None, compression="none", op=None):
        calls.append(compression)
        return optimizer

    mod = types.SimpleNamespace(DistributedOptimizer=build, Other=int)
    guard_constructors(mod, ("DistributedOptimizer", "Other", "Missing"))
    guarded = mod.DistributedOptimizer
    guard_constructors(mod, ("DistributedOptimizer",))
    assert mod.DistributedOptimizer is guarded and guarded.__wrapped__ is build and mod.Other is int
    for args, kwargs in (((1, None, Mine), {}), ((1,), {"compression": Mine})):
        with pytest.raises(CompressionClassError, match=r"compression=Mine\(\)"):
            mod.DistributedOptimizer(*args, **kwargs)
    assert calls == []
    instance, horovod_style = Mine(), type("fp16", (), {"compress": staticmethod(lambda t: (t, None))})
    for value in (instance, horovod_style, "none"):
        assert mod.DistributedOptimizer(7, compression=value) == 7
    assert calls == [instance, horovod_style, "none"]
    with pytest.raises(TypeError):  # bad arguments: the original's own error
        mod.DistributedOptimizer(1, 2, 3, 4, 5)


def test_class_level_compress_says_what_to_write_and_instances_are_untouched():
    from horovod_ext import torch_compression
    from horovod_ext._class_guard import CompressionClassError

    cls = torch_compression.AdaptiveCompression
    assert not hasattr(cls, "compress") and not hasattr(cls, "decompress")  # also an AttributeError
    with pytest.raises(CompressionClassError, match=r"compression=AdaptiveCompression\(\)"):
        cls.compress(torch.zeros(3))
    obj = torch_compression.FP16Compression()
    out, ctx = obj.compress(torch.ones(3))
    assert out.dtype == torch.float16 and torch.equal(obj.decompress(out, ctx), torch.ones(3))
    assert "AdaptiveCompression" in (cls.__doc__ or "")
