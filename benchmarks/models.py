"""Benchmark workloads written for this project: ResNet-18/50/101, VGG-16, a 2-layer LSTM LM, a small decoder-only
transformer LM, an MLP, a small CNN.

torchvision does not import with the CPU build of PyTorch used here, so the models are defined in
plain ``torch.nn``. Each convolutional net comes in two shapes: ``cifar`` (a 3x3 stem without
downsampling, for 32x32 inputs) and ``imagenet`` (a 7x7 stride-2 stem and a max-pool, for 224x224
inputs; smaller sides work too). ``width`` multiplies every channel count (and the LSTM's sizes), so
the same architecture can be made small enough for a 2-core machine: ``width=0.25`` has about 1/16 of
the parameters and compute.

    model = build_model("resnet50", "imagenet", 1000)            # the full-size architecture
    model = build_model("resnet18", "cifar10", 10, width=0.25)   # a CI-sized variant
    model = build_model("lstm", "ptb", 10000, hidden=650, tie_weights=True)
    model = build_model("transformer", "pydoc", 256)                # d_model 128, 2 layers, 4 heads
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from . import registry

__all__ = ["ResNet", "VGG", "LSTMLanguageModel", "TransformerLM", "MLP", "CNN", "build_model", "count_parameters",
           "shape_of"]

# (block kind, blocks per stage) of each ResNet depth
_RESNET_LAYOUT = {18: ("basic", (2, 2, 2, 2)), 50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3))}
# VGG-16 feature extractor: channels of each 3x3 conv, "M" = 2x2 max-pool
_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _scaled(channels: int, width: float) -> int:
    """Channel count times the width multiplier, at least 4 (so tiny variants still have some depth)."""
    return max(4, int(round(channels * width)))


def shape_of(dataset: str) -> str:
    """Which stem a conv net gets for a data set: 'imagenet' for imagenet, 'cifar' for the 32x32 ones."""
    return "imagenet" if dataset == "imagenet" else "cifar"


class _Basic(nn.Module):
    """Two 3x3 convolutions with a skip connection (ResNet-18/34 block); output channels = planes."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.last_bn = self.bn2
        self.shortcut = _projection(inplanes, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, with a skip connection (ResNet-50/101)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.last_bn = self.bn3
        self.shortcut = _projection(inplanes, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + self.shortcut(x))


def _projection(inplanes: int, outplanes: int, stride: int) -> nn.Module:
    """Identity when shapes match, else a strided 1x1 convolution with batch norm."""
    if stride == 1 and inplanes == outplanes:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride=stride, bias=False), nn.BatchNorm2d(outplanes))


class ResNet(nn.Module):
    """ResNet of depth 18, 50 or 101 with a cifar (3x3, stride 1) or imagenet (7x7 + pool) stem."""

    def __init__(self, depth: int, num_classes: int, shape: str = "cifar", width: float = 1.0,
                 in_channels: int = 3) -> None:
        super().__init__()
        if depth not in _RESNET_LAYOUT:
            raise ValueError(f"ResNet depth must be one of {sorted(_RESNET_LAYOUT)}, got {depth}")
        if shape not in ("cifar", "imagenet"):
            raise ValueError(f"shape must be 'cifar' or 'imagenet', got {shape!r}")
        kind, blocks = _RESNET_LAYOUT[depth]
        block: Any = _Basic if kind == "basic" else _Bottleneck
        stem_out = _scaled(64, width)
        if shape == "cifar":
            self.stem = nn.Sequential(nn.Conv2d(in_channels, stem_out, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(stem_out), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, stem_out, 7, stride=2, padding=3, bias=False),
                                      nn.BatchNorm2d(stem_out), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, stride=2, padding=1))
        stages: list[nn.Module] = []
        inplanes = stem_out
        for i, n in enumerate(blocks):
            planes = _scaled(64 * 2**i, width)
            layers = []
            for j in range(n):
                layers.append(block(inplanes, planes, 2 if (i > 0 and j == 0) else 1))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():  # each residual branch starts as zero: the block starts as identity
            if isinstance(m, (_Basic, _Bottleneck)):
                nn.init.zeros_(m.last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class VGG(nn.Module):
    """VGG-16 with batch norm; cifar head: one linear layer, imagenet head: 7x7 pool and 4096-4096 FC."""

    def __init__(self, num_classes: int, shape: str = "cifar", width: float = 1.0, in_channels: int = 3,
                 config: Sequence[Any] = _VGG16, dropout: float = 0.5) -> None:
        super().__init__()
        if shape not in ("cifar", "imagenet"):
            raise ValueError(f"shape must be 'cifar' or 'imagenet', got {shape!r}")
        layers: list[nn.Module] = []
        c = in_channels
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                out = _scaled(int(v), width)
                layers += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
                c = out
        self.features = nn.Sequential(*layers)
        self.shape = shape
        if shape == "cifar":
            self.pool: nn.Module = nn.AdaptiveAvgPool2d(1)
            self.classifier: nn.Module = nn.Linear(c, num_classes)
        else:
            hidden = _scaled(4096, width)
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.classifier = nn.Sequential(nn.Linear(c * 49, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
                                            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
                                            nn.Linear(hidden, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class LSTMLanguageModel(nn.Module):
    """Word-level LM: embedding, a multi-layer LSTM, a linear decoder (optionally tied to the embedding).

    ``forward(tokens[B, T], state)`` returns ``(logits[B, T, vocab], state)``; pass the returned state
    (detached) to the next call to carry it across truncated-BPTT windows.
    """

    def __init__(self, vocab: int, emb: int = 650, hidden: int = 650, layers: int = 2, dropout: float = 0.5,
                 tie_weights: bool = False) -> None:
        super().__init__()
        if tie_weights and emb != hidden:
            raise ValueError(f"tied embeddings need emb == hidden (got emb={emb}, hidden={hidden})")
        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        self.embed = nn.Embedding(vocab, emb)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, dropout=dropout if layers > 1 else 0.0,
                            batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embed.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, state = self.lstm(self.drop(self.embed(tokens)), state)
        return self.decoder(self.drop(out)), state


class _Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # is_causal: position i attends to positions <= i only
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TransformerLM(nn.Module):
    """Decoder-only (GPT-style) LM: token and learned position embeddings, ``layers`` pre-norm blocks of causal
    self-attention, a final layer norm and a decoder tied to the token embedding.

    ``forward(tokens[B, T], state=None)`` returns ``(logits[B, T, vocab], None)``: the LSTM's call shape, so the
    trainer drives both alike; no state is carried between windows (each window is its own context). T must be at
    most ``context``.
    """

    def __init__(self, vocab: int, d_model: int = 128, layers: int = 2, heads: int = 4, context: int = 256,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.context = context
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[_Block(d_model, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d_model)
        self.decoder = nn.Linear(d_model, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.decoder.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"a window of {t} tokens is longer than the model's context ({self.context})")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        return self.decoder(self.ln(self.blocks(self.drop(x)))), None


class MLP(nn.Module):
    """Flatten, then two hidden ReLU layers of ``hidden`` units (the digits demo's model shape)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Two 3x3 convolutions (32 and 64 channels x width, padding 1), each followed by ReLU and a 2x2 max-pool,
    then a hidden layer of 128 x width units and the classes: the classic small MNIST net. On 28x28 grey
    images with 10 classes it has 421 642 parameters, 94 % of them in the hidden layer (3 136 x 128)."""

    def __init__(self, in_channels: int, side: int, num_classes: int, width: float = 1.0) -> None:
        super().__init__()
        if side < 4:
            raise ValueError(f"the cnn pools twice by 2: it needs images of side >= 4, got {side}")
        c1, c2, hidden = _scaled(32, width), _scaled(64, width), _scaled(128, width)
        self.features = nn.Sequential(nn.Conv2d(in_channels, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c2 * (side // 4) ** 2, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_model(name: str, dataset: str, num_outputs: int, *, width: float = 1.0, image_size: int | None = None,
                emb: int | None = None, hidden: int | None = None, tie_weights: bool = False,
                dropout: float | None = None, in_channels: int | None = None, context: int = 256) -> nn.Module:
    """Build a registered model for ``dataset`` with ``num_outputs`` classes (or vocabulary words).

    ``width`` scales channels (conv nets), hidden units (mlp), the LSTM's default 650 units and the transformer's
    d_model of 128 (one head per 32 units); ``emb``/``hidden`` set the LSTM's sizes directly. ``image_size`` is the
    input side (imagenet's default 224), needed by the MLP only; ``context`` the transformer's longest window.
    """
    why = registry.compatible(name, dataset)
    if why:
        raise ValueError(why)
    if not width > 0:
        raise ValueError(f"width must be > 0, got {width}")
    if num_outputs < 2:
        raise ValueError(f"a model needs at least 2 outputs, got {num_outputs}")
    if name == "lstm":
        h = hidden or _scaled(650, width)
        return LSTMLanguageModel(num_outputs, emb=emb or h, hidden=h, layers=2,
                                 dropout=0.5 if dropout is None else dropout, tie_weights=tie_weights)
    if name == "transformer":
        d = max(32, 32 * round(128 * width / 32))
        return TransformerLM(num_outputs, d_model=d, layers=2, heads=d // 32, context=context,
                             dropout=0.0 if dropout is None else dropout)
    c, side, _ = registry.IMAGE_SHAPES[dataset]
    c = in_channels or c
    if image_size:
        side = image_size
    if name == "mlp":
        return MLP(c * side * side, num_outputs, hidden=_scaled(512, width))
    if name == "cnn":
        return CNN(c, side, num_outputs, width=width)
    if name == "vgg16":
        return VGG(num_outputs, shape_of(dataset), width=width, in_channels=c,
                   dropout=0.5 if dropout is None else dropout)
    return ResNet(int(name[len("resnet"):]), num_outputs, shape_of(dataset), width=width, in_channels=c)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
