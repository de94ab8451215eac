"""How a compressed tensor travels, chosen by bytes on the wire (plain numbers, no framework code).

Ring allreduce of m elements of w bytes sends 2 (n-1)/n * m * w bytes per rank; allgather of m
elements per rank sends (n-1) * m * w. Horovod's PyTorch allreduce only takes int32/int64/fp16/fp32/
fp64, so a sparse element travels as an int32 index + an fp32 value (8 bytes) by allgather.
"""

from __future__ import annotations

__all__ = ["ALLGATHER", "ALLREDUCE", "DENSE", "allgather_bytes", "allreduce_bytes", "choose_transport"]

DENSE = "dense"  # allreduce of the whole (error-compensated) tensor
ALLREDUCE = "allreduce"  # allreduce of values at indices every rank shares
ALLGATHER = "allgather"  # allgather of (index, value) pairs chosen by each rank

INDEX_BYTES = 4
VALUE_BYTES = 4


def allreduce_bytes(elements: int, world_size: int, width: int = VALUE_BYTES) -> float:
    """Bytes one rank sends in a ring allreduce of `elements` values of `width` bytes."""
    return 2.0 * (world_size - 1) / world_size * elements * width


def allgather_bytes(elements: int, world_size: int, width: int = INDEX_BYTES + VALUE_BYTES) -> float:
    """Bytes one rank sends in a ring allgather contributing `elements` items of `width` bytes."""
    return float(world_size - 1) * elements * width


def choose_transport(numel: int, k: int, world_size: int, shared_indices: bool) -> str:
    """DENSE, ALLREDUCE or ALLGATHER for a tensor of `numel` elements compressed to `k` elements.

    Shared indices sum correctly, so they always go by allreduce of k values. Rank-specific
    indices need allgather, which only pays while k < numel / world_size: beyond that the dense
    allreduce sends fewer bytes (the sum is then exact anyway).
    """
    if world_size < 1 or numel < 1 or k < 1:
        raise ValueError(f"need world_size, numel and k >= 1, got {world_size}, {numel}, {k}")
    if k >= numel:
        return DENSE
    if shared_indices:
        return ALLREDUCE
    if allgather_bytes(k, world_size) < allreduce_bytes(numel, world_size):
        return ALLGATHER
    return DENSE
