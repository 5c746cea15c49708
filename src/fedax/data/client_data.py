"""Federated data held once, and the per-round cohort batching built on it.

:class:`ClientData` stores every example once (flat ``x``/``y``) plus each client's example
indices. :func:`make_cohort` turns a round's sampled clients into host-side index and mask
arrays of shape ``[C, S, B]`` (clients, local steps, batch): client k takes exactly
``E * ceil(n_k / B)`` real steps (``E_k`` with per-client epochs, e.g. for stragglers); later
steps and the tail of each epoch's last batch are padding with mask 0.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import numpy as np

# Step counts up to this are used as they are; larger ones are bucketed (see `bucket_size`).
_EXACT_UP_TO = 8


@dataclasses.dataclass(frozen=True, eq=False)
class ClientData:
    """All examples once, plus each client's examples as index ranges.

    Attributes:
      x: Inputs, ``[N, ...]``.
      y: Targets, ``[N, ...]``.
      indices: int64 ``[M]``: every client's example indices into ``x``/``y``, concatenated.
      offsets: int64 ``[K + 1]``: client k owns ``indices[offsets[k]:offsets[k + 1]]``.
    """

    x: np.ndarray
    y: np.ndarray
    indices: np.ndarray
    offsets: np.ndarray

    def __post_init__(self):
        n = len(self.x)
        if len(self.y) != n:
            raise ValueError(f"x has {n} examples but y has {len(self.y)}")
        if self.indices.ndim != 1 or self.indices.dtype != np.int64:
            raise ValueError(
                f"indices must be int64 [M], got {self.indices.dtype} {self.indices.shape}"
            )
        if self.offsets.ndim != 1 or self.offsets.dtype != np.int64 or len(self.offsets) < 2:
            raise ValueError(
                f"offsets must be int64 [K + 1] with K >= 1, got "
                f"{self.offsets.dtype} {self.offsets.shape}"
            )
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.indices):
            raise ValueError("offsets must start at 0 and end at len(indices)")
        if np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must be non-decreasing")
        if self.indices.size and (self.indices.min() < 0 or self.indices.max() >= n):
            raise ValueError(f"indices must lie in [0, {n})")

    @classmethod
    def from_partition(cls, x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> ClientData:
        """Builds from a partition: ``parts[k]`` holds client k's example indices."""
        if not parts:
            raise ValueError("parts must name at least one client")
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        indices = np.concatenate([np.asarray(p).reshape(-1) for p in parts]).astype(np.int64)
        return cls(np.asarray(x), np.asarray(y), indices, offsets)

    @property
    def num_clients(self) -> int:
        """K, the number of clients."""
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[K]``: n_k, the number of examples of each client."""
        return np.diff(self.offsets)

    def client_indices(self, k: int) -> np.ndarray:
        """Client k's example indices into ``x``/``y``."""
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {k} out of range [0, {self.num_clients})")
        return self.indices[self.offsets[k] : self.offsets[k + 1]]


class Cohort(NamedTuple):
    """Host-side (NumPy) description of one round's local batches.

    Attributes:
      client_ids: int32 ``[C]``.
      idx: int32 ``[C, S, B]``: example index into ``ClientData.x``/``.y`` (0 where padded).
      mask: float32 ``[C, S, B]``: 1 for a real example, 0 for padding.
      num_examples: float32 ``[C]``: n_k.
    """

    client_ids: np.ndarray
    idx: np.ndarray
    mask: np.ndarray
    num_examples: np.ndarray


def _finite_batch(batch_size) -> int | None:
    """None for B = inf (``None`` or ``math.inf``), else the validated finite batch size."""
    if batch_size is None or (isinstance(batch_size, float) and batch_size == math.inf):
        return None
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, numbers.Integral)
        or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive int, None or math.inf; got {batch_size!r}")
    return int(batch_size)


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_epochs(epochs, num_clients: int) -> np.ndarray:
    """int64 ``[C]`` epochs per client from an int or a per-client array; all must be >= 1."""
    if np.ndim(epochs) == 0:
        if isinstance(epochs, np.ndarray):
            epochs = epochs.item()
        return np.full(num_clients, _check_positive_int(epochs, "epochs"), np.int64)
    array = np.asarray(epochs)
    if (
        array.shape != (num_clients,)
        or not np.issubdtype(array.dtype, np.integer)
        or np.any(array < 1)
    ):
        raise ValueError(
            f"epochs must be a positive int or {num_clients} positive ints (one per client), "
            f"got {epochs!r}"
        )
    return array.astype(np.int64)


def num_local_steps(n_k: int, epochs: int, batch_size: int | float | None) -> int:
    """Local steps of a client with ``n_k`` examples: ``E * ceil(n_k / B)``.

    ``batch_size`` None or ``math.inf`` means full batch: E steps (0 for an empty client).
    """
    epochs = _check_positive_int(epochs, "epochs")
    if n_k < 0:
        raise ValueError(f"n_k must be >= 0, got {n_k}")
    finite = _finite_batch(batch_size)
    if finite is None:
        return epochs * int(n_k > 0)
    return epochs * -(-int(n_k) // finite)


def bucket_size(n: int) -> int:
    """Rounds a step count up to one of a few sizes per power of two, to limit recompiles.

    Counts up to 8 are kept; larger ones are rounded up to a multiple of ``2**(floor(log2 n) -
    2)``: four sizes per octave (9 -> 10, 17 -> 20, 1200 -> 1280), so padding stays below 25%
    (rounding to the next power of two would pad up to 100%).
    """
    if n <= _EXACT_UP_TO:
        return n
    quantum = 1 << (n.bit_length() - 3)
    return -(-n // quantum) * quantum


def make_cohort(
    data: ClientData,
    client_ids,
    epochs: int | np.ndarray,
    batch_size: int | float | None,
    seed_or_rng: int | np.random.Generator,
    num_steps: int | None = None,
    bucket: bool = True,
    full_batch_size: int | None = None,
    client_streams: tuple[int, ...] | None = None,
) -> Cohort:
    """Builds one round's local batches for the given clients.

    For each epoch, client k's examples are reshuffled (a fresh permutation drawn from the rng)
    and cut into consecutive batches of B; the epoch's last batch may be partial. Client k thus
    takes ``E * ceil(n_k / B)`` real steps, followed by fully masked padding steps up to S.
    With B = inf (``None`` or ``math.inf``) each epoch is one step holding all n_k examples, in
    a batch of size ``B_eff = max n_k`` over the cohort (or ``full_batch_size``).

    All randomness comes from ``seed_or_rng``, consumed client by client in ``client_ids``
    order, so the cohort is a pure function of (data, client_ids, E, B, seed); the real entries
    do not depend on ``num_steps``/``bucket``/``full_batch_size``. With ``client_streams``
    (e.g. ``(seed, t)``), client k's shuffles come from its own ``default_rng([*client_streams,
    k])`` instead: they follow the client, not its position or its cohort, so a client that
    shuffles its own data (``fedax.runtime``) makes exactly the simulator's batches.

    Per-client epochs (``epochs`` an int array ``[C]``, aligned with ``client_ids``) simulate
    stragglers that do less local work (FedProx's "x ~ U[1, E] epochs"): client c then takes
    ``epochs[c] * ceil(n_k / B)`` real steps, and S covers the largest. Randomness is
    consumed as with an int (one permutation per client and epoch, client by client), so an
    array whose entries all equal E gives exactly the cohort of ``epochs=E``.

    Args:
      data: The federated data set.
      client_ids: ``[C]`` ids of the round's clients.
      epochs: E >= 1, or an int array ``[C]`` of per-client E_c >= 1.
      batch_size: B, a positive int (it may exceed some or all n_k), or None / ``math.inf``.
      seed_or_rng: An int seed or a ``np.random.Generator`` (which is advanced).
      num_steps: Fixed S; must be at least the largest step count in the cohort.
      bucket: Without ``num_steps``, round S up with :func:`bucket_size` (else S is exact).
      full_batch_size: Fixed B_eff for B = inf; must be at least the largest n_k in the cohort.
      client_streams: Seed words of each client's own shuffle stream (see above); None: one
        stream, ``seed_or_rng``, for the cohort.

    Returns:
      A :class:`Cohort` with ``idx``/``mask`` of shape ``[C, S, B]`` (B_eff for B = inf).

    Raises:
      ValueError: Bad E, B, client ids, or a ``num_steps``/``full_batch_size`` too small.
    """
    rng = np.random.default_rng(seed_or_rng)
    finite = _finite_batch(batch_size)
    ids = np.asarray(client_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"client_ids must be a non-empty 1-D int array, got {ids!r}")
    epochs = _check_epochs(epochs, len(ids))
    if ids.min() < 0 or ids.max() >= data.num_clients:
        raise ValueError(f"client_ids must lie in [0, {data.num_clients})")
    if len(data.x) > np.iinfo(np.int32).max:
        raise ValueError("too many examples for int32 indices")
    sizes = data.sizes[ids]

    if finite is None:
        batch = max(int(sizes.max()), 1)
        if full_batch_size is not None:
            if _check_positive_int(full_batch_size, "full_batch_size") < batch:
                raise ValueError(f"full_batch_size={full_batch_size} < largest n_k {batch}")
            batch = int(full_batch_size)
        steps_per_epoch = (sizes > 0).astype(np.int64)
    else:
        if full_batch_size is not None:
            raise ValueError("full_batch_size applies only to batch_size None / math.inf")
        batch = finite
        steps_per_epoch = -(-sizes // batch)

    needed = max(int((epochs * steps_per_epoch).max()), 1)
    if num_steps is not None:
        if _check_positive_int(num_steps, "num_steps") < needed:
            raise ValueError(f"num_steps={num_steps} < {needed} steps needed by the cohort")
        total_steps = int(num_steps)
    else:
        total_steps = bucket_size(needed) if bucket else needed

    idx = np.zeros((len(ids), total_steps, batch), np.int32)
    mask = np.zeros((len(ids), total_steps, batch), np.float32)
    for c, k in enumerate(ids):
        n, spe, e = int(sizes[c]), int(steps_per_epoch[c]), int(epochs[c])
        if n == 0:
            continue
        stream = rng if client_streams is None else np.random.default_rng(
            [*client_streams, int(k)])
        perms = stream.permuted(np.broadcast_to(np.arange(n), (e, n)), axis=1)
        width = spe * batch
        rows_idx = np.zeros((e, width), np.int32)
        rows_idx[:, :n] = data.client_indices(int(k))[perms]
        rows_mask = np.zeros((e, width), np.float32)
        rows_mask[:, :n] = 1.0
        idx[c, : e * spe] = rows_idx.reshape(e * spe, batch)
        mask[c, : e * spe] = rows_mask.reshape(e * spe, batch)
    return Cohort(ids.astype(np.int32), idx, mask, sizes.astype(np.float32))


def sample_clients(
    rng_or_seed: int | np.random.Generator, num_clients: int, fraction: float
) -> np.ndarray:
    """Samples the round's clients: ``m = max(floor(C * K), 1)`` distinct ids, uniformly.

    As in McMahan et al.'s Algorithm 1 (C = 0 selects one client). The ids are returned in
    sampling order (not sorted), as int64.

    Raises:
      ValueError: ``num_clients < 1`` or ``fraction`` outside [0, 1].
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    # The small tolerance keeps e.g. 0.29 * 100 = 28.999999999999996 at 29.
    m = min(max(math.floor(fraction * num_clients + 1e-9), 1), num_clients)
    rng = np.random.default_rng(rng_or_seed)
    return rng.choice(num_clients, size=m, replace=False).astype(np.int64)
