"""The k-regular neighbour graph of SecAgg+ (Bell et al., CCS 2020).

The server shuffles the sampled ids with a public seed (sorted by SHA-256(seed || id)),
places them on a ring, and makes each node a neighbour of the nodes at ring offsets
``-(k//2) .. k//2`` (itself excluded): a circulant graph in which every node has ``k - 1``
neighbours, the same as Flower's SecAgg+ (papers section 12). ``k`` counts the node itself,
as it counts the holders of a node's shares (the node keeps one). ``k`` must be odd, or
equal to the number of nodes, which gives the complete graph of SecAgg (Bonawitz et al.).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

MAX_ID = 2**32 - 2  # a share's evaluation point id + 1 must fit in 32 bits


def check_num_shares(num_shares: int, num_nodes: int) -> None:
    """Raise ValueError unless ``num_shares`` fits a ring graph of ``num_nodes`` nodes."""
    if not 1 <= num_shares <= num_nodes:
        raise ValueError(f"num_shares {num_shares} must be in [1, num_clients {num_nodes}]")
    if num_shares % 2 == 0 and num_shares != num_nodes:
        raise ValueError(f"num_shares {num_shares} must be odd (use {num_shares + 1}) "
                         f"or equal num_clients {num_nodes}")


def default_num_shares(num_nodes: int) -> int:
    """2 * ceil(log2 n) + 1, Bell et al.'s logarithmic degree; n (complete) when larger."""
    k = 2 * math.ceil(math.log2(max(num_nodes, 2))) + 1
    return num_nodes if k >= num_nodes else k


def ring_graph(ids: Iterable[int], num_shares: int, seed: bytes) -> dict[int, tuple[int, ...]]:
    """Each id's neighbours (sorted, itself excluded) in the shuffled ring graph."""
    nodes = list(ids)
    if len(set(nodes)) != len(nodes) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_ID for i in nodes):
        raise ValueError(f"ids must be distinct integers in [0, {MAX_ID}]")
    check_num_shares(num_shares, len(nodes))
    ring = sorted(nodes, key=lambda i: hashlib.sha256(seed + i.to_bytes(8, "big")).digest())
    n, half = len(ring), num_shares // 2
    return {node: tuple(sorted({ring[(p + o) % n] for o in range(-half, half + 1)} - {node}))
            for p, node in enumerate(ring)}
