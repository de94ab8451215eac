"""A small real training task for demos and tests: scikit-learn's digits (ships with it, no download).

`train_digits` runs inside a Horovod rank: each rank trains on its own shard, gradients go through
`hvd.DistributedOptimizer` with the given compression, and it returns accuracy and bytes figures.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (1797 8x8 images, 10 classes), standardised, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def make_model(hidden: int = 512) -> torch.nn.Module:
    """An MLP big enough that compression has something to do (about 300 k parameters)."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def train_digits(compression: Any = None, epochs: int = 20, batch_size: int = 32, lr: float = 0.2,
                 seed: int = 0, hidden: int = 512, momentum: float = 0.0,
                 on_step: Any = None) -> dict[str, Any]:
    """Train on this rank's shard; return accuracy, loss per epoch, dense gradient bytes and time."""
    import horovod.torch as hvd

    torch.manual_seed(seed)
    xtr, ytr, xte, yte = load_digits_split(seed)
    shard = slice(hvd.rank(), None, hvd.size())
    xtr, ytr = xtr[shard], ytr[shard]
    model = make_model(hidden)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kwargs = {} if compression is None else {"compression": compression}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters(), **kwargs)
    dense_bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    steps, history = 0, []
    gen = torch.Generator().manual_seed(seed + 1)
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(xtr), generator=gen)
        total = 0.0
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i:i + batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
            if on_step is not None:
                on_step(steps, compression)
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        history.append({"epoch": epoch + 1, "loss": total / max(1, len(order) // batch_size),
                        "test_accuracy": acc})
    elapsed = time.perf_counter() - start
    weights_sum = sum(p.detach().double().sum().item() for p in model.parameters())
    stats = compression.stats() if hasattr(compression, "stats") else None
    return {"rank": hvd.rank(), "size": hvd.size(), "steps": steps, "epochs": epochs,
            "final_accuracy": history[-1]["test_accuracy"], "history": history,
            "dense_bytes": dense_bytes_per_step * steps, "seconds": elapsed,
            "parameters": sum(p.numel() for p in model.parameters()), "weights_checksum": weights_sum,
            "bytes_sent": stats["bytes_sent"] if stats else dense_bytes_per_step * steps,
            "compression": {k: v for k, v in stats.items() if not k.startswith("policy/")} if stats else None,
            "last3_accuracy": sum(h["test_accuracy"] for h in history[-3:]) / len(history[-3:])}


def paper_search_compression() -> Any:
    """GraVAC's paper search (an option, not the default) with the settings test_compression_hvd's digits
    test trains with: it decides on gains alone, so it compresses on any link (loopback included)."""
    from crossover import AdaptiveCompression

    return AdaptiveCompression("topk", search="paper", gain="norm", cf_min=30, cf_max=1000, epsilon=0.15,
                               window=100, min_compress_numel=4096)
