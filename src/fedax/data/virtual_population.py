"""Virtual populations of up to millions of clients whose data is made on demand.

* :class:`VirtualPopulation`: N clients whose data is a pure function of (seed, client id),
  generated when the client is sampled (Synthetic(α, β)-style), so a round costs O(cohort).
* :func:`sample_cohort`: C distinct ids out of N in O(C) time and memory (Floyd's
  algorithm), where ``rng.choice(N, C, replace=False)`` is O(N).

Nothing of size N is ever materialised. The runner for this mode is
``fedax.simulation.population.run_population``; per-client algorithm state lives in
``fedax.simulation.client_state.ClientStateStore``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fedax.data.client_data import ClientData
from fedax.data.synthetic import COV_EXPONENT, SIZE_LOG_MEAN, SIZE_LOG_SIGMA, SIZE_OFFSET

Split = Literal["train", "test", "all"]
_MAX_CLIENTS = np.iinfo(np.int32).max  # cohorts carry int32 client ids


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _client_ids(ids, num_clients: int) -> np.ndarray:
    array = np.asarray(ids)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"client ids must be a 1-D int array, got {ids!r}")
    if array.size and (array.min() < 0 or array.max() >= num_clients):
        raise ValueError(f"client ids must lie in [0, {num_clients})")
    return array.astype(np.int64)


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class VirtualPopulation:
    """N Synthetic(α, β)-style clients whose data is generated on demand.

    Client k's examples are a pure function of ``(seed, k)`` (and the fields below): they
    come from its own generator ``np.random.default_rng(np.random.SeedSequence(seed,
    spawn_key=(k,)))``, i.e. the k-th child of ``SeedSequence(seed).spawn``, drawn in this
    order: n_k (unless ``sizes`` is fixed); for the heterogeneous variant u_k ~ N(0, α²),
    B_k ~ N(0, β²), v_k ~ N(B_k, 1)^dim, W_k ~ N(u_k, 1)^{dim×classes}, b_k ~ N(u_k, 1)^classes;
    then z ~ N(0, I) of shape ``[n_k, dim]``, x = v_k + sqrt(diag Σ) ⊙ z stored as float32 with
    Σ_jj = j^-1.2, and y = argmax(x W_k + b_k) from the float32 x, in float64. Generating a
    cohort costs O(cohort); nothing is stored per client.

    Relation to :func:`fedax.data.synthetic`: the same distribution family, per client, with
    the same Σ, the same labelling rule, the same IID variant (one W, b for everyone, v = 0)
    and the same size law ``int(LogNormal(4, 2)) + 50``. What differs:

    - Randomness: one generator per client instead of one stream for the whole data set
      (where u, B and v are drawn for all clients first, then each client's W_k, b_k, z in
      turn), so client k here is *not* client k of ``synthetic(..., seed=seed)``; the shared
      IID W, b come from ``default_rng(SeedSequence(seed))``.
    - Sizes: the power law is truncated at ``max_size`` (``min(int(LogNormal(4, 2)) + 50,
      max_size)``). Over a million clients the untruncated law reaches ~10⁶ examples for one
      client, and the largest client sets the round's fixed shapes.
    - Labels: the logits are a float64 matrix product (``synthetic`` accumulates them
      elementwise in a fixed order, ~15x slower, to be bit-identical on every machine).
      A client's data is identical whenever it is generated on one machine; across
      machines a label could differ only where two logits tie to rounding.
    - Nothing is materialised: :meth:`client_data` builds a ``ClientData`` for the given ids
      only. The train/test split within a client is the same (first
      ``floor(train_fraction · n_k)`` examples train).

    Attributes:
      num_clients: N (up to 2³¹ − 1).
      alpha, beta: α, β >= 0 (standard deviations, as in the authors' generator).
      dim, num_classes: 60 and 10 in the paper.
      seed: The population's seed (independent of the run's seed).
      iid: The IID variant (α and β ignored).
      sizes: None for the truncated power law, or one positive int for every client.
      max_size: Truncation of the power law (ignored with fixed ``sizes``).
      train_fraction: In (0, 1], each client's share of training examples.
    """

    num_clients: int
    alpha: float = 1.0
    beta: float = 1.0
    dim: int = 60
    num_classes: int = 10
    seed: int = 0
    iid: bool = False
    sizes: int | None = None
    max_size: int = 200
    train_fraction: float = 0.9
    _shared: tuple[np.ndarray, np.ndarray] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        n = _positive_int(self.num_clients, "num_clients")
        if n > _MAX_CLIENTS:
            raise ValueError(f"num_clients must be at most {_MAX_CLIENTS}, got {n}")
        _positive_int(self.dim, "dim")
        _positive_int(self.num_classes, "num_classes")
        _positive_int(self.max_size, "max_size")
        if self.sizes is not None:
            _positive_int(self.sizes, "sizes")
        if not self.iid and not (
            self.alpha >= 0 and self.beta >= 0 and math.isfinite(self.alpha + self.beta)
        ):
            raise ValueError(
                f"alpha and beta must be finite and >= 0, got {self.alpha!r}, {self.beta!r}"
            )
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"train_fraction must be in (0, 1], got {self.train_fraction!r}")
        if self.iid:
            rng = np.random.default_rng(np.random.SeedSequence(self.seed))
            shared = (
                rng.normal(0.0, 1.0, (self.dim, self.num_classes)),
                rng.normal(0.0, 1.0, self.num_classes),
            )
            object.__setattr__(self, "_shared", shared)

    @property
    def largest_client(self) -> int:
        """The largest n_k any client can have (``sizes``, or ``max_size``)."""
        return int(self.sizes) if self.sizes is not None else int(self.max_size)

    def capacity(self, split: Split = "train") -> int:
        """Rows per client in :meth:`client_data`'s fixed layout: a bound on the split's
        size for every client (``floor(train_fraction · largest_client)`` for train)."""
        if split == "train":
            return math.floor(self.train_fraction * self.largest_client)
        if split in ("test", "all"):
            return self.largest_client
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")

    def _rng(self, k: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(int(k),)))

    def _size(self, rng: np.random.Generator) -> int:
        if self.sizes is not None:
            return int(self.sizes)
        n = int(rng.lognormal(SIZE_LOG_MEAN, SIZE_LOG_SIGMA)) + SIZE_OFFSET
        return min(n, int(self.max_size))

    def sizes_of(self, ids) -> np.ndarray:
        """int64 n_k (all examples, before the train/test split) of the given clients."""
        ids = _client_ids(ids, self.num_clients)
        return np.array([self._size(self._rng(k)) for k in ids], np.int64)

    def client(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client k's n_k examples: x float32 ``[n_k, dim]``, y int32 ``[n_k]``."""
        if not 0 <= int(k) < self.num_clients:
            raise IndexError(f"client {k} out of range [0, {self.num_clients})")
        rng = self._rng(k)
        n = self._size(rng)
        if self.iid:
            assert self._shared is not None  # set by __post_init__ when iid
            w, b = self._shared
            mean = np.zeros(self.dim)
        else:
            u = rng.normal(0.0, float(self.alpha))
            big_b = rng.normal(0.0, float(self.beta))
            mean = rng.normal(big_b, 1.0, self.dim)
            w = rng.normal(u, 1.0, (self.dim, self.num_classes))
            b = rng.normal(u, 1.0, self.num_classes)
        scale = np.power(np.arange(1, self.dim + 1, dtype=np.float64), COV_EXPONENT / 2)
        z = rng.standard_normal((n, self.dim))
        x = (mean + scale * z).astype(np.float32)
        logits = x.astype(np.float64) @ w + b
        return x, np.argmax(logits, axis=1).astype(np.int32)

    def _split(self, k: int, split: Split) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.client(k)
        if split == "all":
            return x, y
        cut = math.floor(self.train_fraction * len(y))
        return (x[:cut], y[:cut]) if split == "train" else (x[cut:], y[cut:])

    def client_data(self, ids, split: Split = "train", fixed_layout: bool = False) -> ClientData:
        """The given clients' examples as a ``ClientData`` whose client j is ``ids[j]``.

        With ``fixed_layout``, client j's examples occupy rows ``j·T .. j·T + n_j − 1`` of
        ``x``/``y`` (``T = capacity(split)``, the rest zero), so the arrays have the same
        shape ``[len(ids) · T, ...]`` whichever clients are asked for. Otherwise the
        clients' examples are concatenated.
        """
        ids = _client_ids(ids, self.num_clients)
        if len(ids) == 0:
            raise ValueError("client_data needs at least one client id")
        parts = [self._split(int(k), split) for k in ids]
        counts = np.array([len(y) for _, y in parts], np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if not fixed_layout:
            x = np.concatenate([x for x, _ in parts]).reshape(-1, self.dim)
            y = np.concatenate([y for _, y in parts]).astype(np.int32)
            return ClientData(x, y, np.arange(len(y), dtype=np.int64), offsets)
        rows = self.capacity(split)
        x = np.zeros((len(ids) * rows, self.dim), np.float32)
        y = np.zeros(len(ids) * rows, np.int32)
        indices = np.empty(int(offsets[-1]), np.int64)
        for j, (xj, yj) in enumerate(parts):
            start = j * rows
            x[start : start + len(yj)] = xj
            y[start : start + len(yj)] = yj
            indices[offsets[j] : offsets[j + 1]] = np.arange(start, start + len(yj))
        return ClientData(x, y, indices, offsets)


def sample_cohort(
    rng_or_seed: int | np.random.Generator, num_clients: int, cohort_size: int
) -> np.ndarray:
    """``cohort_size`` distinct client ids out of ``num_clients``, uniformly, sorted (int64).

    Floyd's algorithm (Bentley & Floyd, CACM 1987): for j = N − C, ..., N − 1 draw t
    uniform in [0, j] and take t, or j if t is already taken. Every C-subset is equally
    likely, and time and memory are O(C) whatever N (NumPy's ``choice(N, C,
    replace=False)`` permutes all N). Sorted, so gathers from a memory-mapped store touch
    the file in order.
    """
    num_clients = _positive_int(num_clients, "num_clients")
    cohort_size = _positive_int(cohort_size, "cohort_size")
    if cohort_size > num_clients:
        raise ValueError(f"cohort_size={cohort_size} > num_clients={num_clients}")
    rng = np.random.default_rng(rng_or_seed)
    tops = np.arange(num_clients - cohort_size, num_clients, dtype=np.int64)
    draws = rng.integers(0, tops + 1)  # t_j uniform in [0, j], all drawn at once
    chosen: set[int] = set()
    for j, t in zip(tops.tolist(), draws.tolist(), strict=True):
        chosen.add(j if t in chosen else t)
    return np.array(sorted(chosen), np.int64)
