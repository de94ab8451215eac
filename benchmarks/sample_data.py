"""Write small data sets in the real on-disk formats, for tests and for trying the CLI without downloads.

    python -m benchmarks.sample_data cifar10 /tmp/cifar10     # data_batch_1..5, test_batch, batches.meta
    python -m benchmarks.sample_data cifar100 /tmp/cifar100   # train, test, meta
    python -m benchmarks.sample_data imagenet /tmp/imagenet   # train/<class>/*.JPEG, val/<class>/*.png
    python -m benchmarks.sample_data ptb /tmp/ptb             # ptb.train.txt, ptb.valid.txt, ptb.test.txt

The images carry a class-dependent colour so that a model can learn something from them.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

__all__ = ["write_cifar", "write_imagenet", "write_ptb", "main"]


def _images(n: int, classes: int, side: int, seed: int) -> tuple[object, list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    base = rng.integers(0, 256, (classes, 3, 1, 1))
    x = np.clip(base[labels] + rng.normal(0, 40, (n, 3, side, side)), 0, 255).astype(np.uint8)
    return x, [int(v) for v in labels]


def write_cifar(root: str | Path, name: str = "cifar10", n_train: int = 100, n_test: int = 40, seed: int = 0) -> Path:
    """Write CIFAR-10 (5 train batches) or CIFAR-100 python pickles with random images into ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    classes = 10 if name == "cifar10" else 100
    x, y = _images(n_train + n_test, classes, 32, seed)
    flat = x.reshape(len(y), -1)  # type: ignore[attr-defined]

    def dump(path: Path, obj: dict[bytes, object]) -> None:
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=2)

    if name == "cifar10":
        parts = [list(range(n_train))[i::5] for i in range(5)]
        for i, idx in enumerate(parts, start=1):
            dump(root / f"data_batch_{i}", {b"batch_label": f"training batch {i} of 5".encode(),
                                             b"labels": [y[j] for j in idx], b"data": flat[idx],
                                             b"filenames": [f"img{j}.png".encode() for j in idx]})
        dump(root / "test_batch", {b"labels": y[n_train:], b"data": flat[n_train:]})
        dump(root / "batches.meta", {b"label_names": [f"class{i}".encode() for i in range(10)],
                                     b"num_cases_per_batch": n_train // 5, b"num_vis": 3072})
    elif name == "cifar100":
        dump(root / "train", {b"fine_labels": y[:n_train], b"coarse_labels": [v // 5 for v in y[:n_train]],
                              b"data": flat[:n_train]})
        dump(root / "test", {b"fine_labels": y[n_train:], b"coarse_labels": [v // 5 for v in y[n_train:]],
                             b"data": flat[n_train:]})
        dump(root / "meta", {b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
                             b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]})
    else:
        raise ValueError(f"name must be cifar10 or cifar100, got {name!r}")
    return root


def write_imagenet(root: str | Path, classes: int = 3, per_class: int = 4, val_per_class: int = 2,
                   side: tuple[int, int] = (48, 40), seed: int = 0) -> Path:
    """Write ``train/<class>/*.JPEG`` and ``val/<class>/*.png`` images of size ``side`` (w, h) into ``root``."""
    import numpy as np
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    for c in range(classes):
        colour = rng.integers(0, 256, 3)
        for split, n, ext in (("train", per_class, "JPEG"), ("val", val_per_class, "png")):
            d = root / split / f"n{c:08d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = np.clip(colour + rng.normal(0, 30, (side[1], side[0], 3)), 0, 255).astype(np.uint8)
                Image.fromarray(arr).save(d / f"img{i}.{ext}")
    return root


def write_ptb(root: str | Path, lines: int = 200, vocab: int = 50, seed: int = 0) -> Path:
    """Write ptb.train.txt / ptb.valid.txt / ptb.test.txt of short lines over ``vocab`` words (and <unk>)."""
    import numpy as np

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(vocab)] + ["<unk>"]
    for split, n in (("train", lines), ("valid", max(4, lines // 5)), ("test", max(4, lines // 5))):
        text = []
        for _ in range(n):
            start = int(rng.integers(0, vocab))
            length = int(rng.integers(3, 12))
            text.append(" " + " ".join(words[(start + 3 * k) % len(words)] for k in range(length)) + " ")
        (root / f"ptb.{split}.txt").write_text("\n".join(text) + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    """Command line: write one sample data set."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", choices=("cifar10", "cifar100", "imagenet", "ptb"))
    p.add_argument("dir")
    a = p.parse_args(argv)
    if a.dataset in ("cifar10", "cifar100"):
        write_cifar(a.dir, a.dataset, n_train=500, n_test=100)
    elif a.dataset == "imagenet":
        write_imagenet(a.dir, classes=4, per_class=16, val_per_class=4, side=(80, 64))
    else:
        write_ptb(a.dir, lines=2000)
    print(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
