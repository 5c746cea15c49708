"""Cohort sources: where the runner's rounds get their clients.

The runner (``fedax.simulation.run``) is one loop; what differs between a partitioned data
set, a virtual population of millions and a train + holdout pair for a hypergradient is only
how round t's cohort is made. A source does three things:

* ``place(home)``: put what lives on the device for the whole run there, once (the training
  set of a ``ClientData``; nothing for a population);
* ``round_data(t, pad_to)``: on the host, round t's ``RoundData``: the arrays the round
  needs (``sharded``: split over the mesh's clients axis; ``plain``: passed as they are),
  the population ids of its real clients (for per-client state kept on the host) and their
  number. Pure in (seed, t), so any round can be made again (resume);
* ``cohort(placed, sharded, plain, block_spec)``: inside the compiled round, the cohort
  the algorithm receives (``CohortBatches``, or a ``HyperCohort``).

``identity()`` lists what identifies the source's rounds for checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from fedax.algorithms import CohortBatches
from fedax.client import Batches
from fedax.data import (
    ClientData,
    Cohort,
    VirtualPopulation,
    make_cohort,
    num_local_steps,
    sample_clients,
    sample_cohort,
)
from fedax.federated._lockstep import host_steps
from fedax.hyper import HyperCohort
from fedax.simulation import checkpoint as ckpt
from fedax.simulation.device_data import cohort_features, put_features, take
from fedax.simulation.stragglers import drop_stragglers, straggler_epochs


class RoundData(NamedTuple):
    """One round's host-side input (see the module docstring)."""

    sharded: Any
    plain: Any
    ids: np.ndarray | None
    real: int
    size: int
    steps: np.ndarray | None = None  # [size] real steps per client, when the host knows


class CohortSource(Protocol):
    @property
    def num_clients(self) -> int: ...  # (read-only: the sources' is a property)

    def place(self, home) -> Any: ...

    def round_data(self, t: int, pad_to: int) -> RoundData: ...

    def cohort(self, placed: Any, sharded: Any, plain: Any, block_spec) -> Any: ...

    def identity(self) -> dict[str, Any]: ...


def pad_cohort(cohort: Cohort, multiple: int) -> Cohort:
    """Pad with empty clients (no real steps, weight n_k = 0) to a multiple of ``multiple``,
    so a cohort splits evenly over devices; padded clients change no aggregate."""
    extra = -len(cohort.client_ids) % multiple
    if extra == 0:
        return cohort

    def pad(a):
        return np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])

    return Cohort(*(pad(a) for a in cohort))


def _steps(largest: int, local_epochs: int, batch_size: float) -> tuple[int, int]:
    """Fixed shapes for every round (no recompilation): B = ∞ is one full batch of the
    largest client, and S covers the largest client's E·⌈n_k/B⌉ steps."""
    batch = int(largest) if math.isinf(batch_size) else int(batch_size)
    return batch, num_local_steps(int(largest), local_epochs, batch)


@dataclass
class PartitionSource:
    """McMahan et al.'s rounds over a partitioned data set: round t samples
    ``max(C·K, 1)`` clients from ``default_rng([seed, t])``, and client k shuffles its
    examples with its own ``default_rng([seed, t, k])`` (as a networked client does, so the
    engines make the same batches); the
    training set lives on the device once (8-bit codes for k/255 images), and a cohort
    travels as example indices ``[C, S, B]`` plus masks, gathered inside the round.

    ``straggler_fraction`` and ``drop_stragglers``: FedProx's systems heterogeneity (see
    ``fedax.simulation.run``).

    ``sampling="poisson"``: instead, every client joins round t independently with
    probability q = ``client_fraction`` (McMahan et al. 2018's sampling, which the privacy
    accountant's Poisson figures assume); the cohort's size varies, and it is padded with
    empty clients to a fixed capacity, the size exceeded with probability below 1e-9, so
    the round compiles once (a round that draws more raises, never truncates)."""

    train: ClientData
    client_fraction: float
    local_epochs: int
    batch_size: float
    seed: int = 0
    straggler_fraction: float = 0.0
    drop_stragglers: bool = False
    sampling: str = "fixed"
    _table: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not 0.0 <= self.straggler_fraction <= 1.0:
            raise ValueError(
                f"straggler_fraction must be in [0, 1], got {self.straggler_fraction}.")
        size = len(sample_clients(0, self.train.num_clients, self.client_fraction))
        if self.drop_stragglers and round(self.straggler_fraction * size) >= size:
            raise ValueError(
                f"drop_stragglers with straggler_fraction={self.straggler_fraction} makes "
                f"all {size} clients of a cohort stragglers; a round could drop every client "
                "(no weight to average). Use a smaller fraction or keep the stragglers."
            )
        self.batch, self.num_steps = _steps(int(self.train.sizes.max()), self.local_epochs,
                                            self.batch_size)
        if self.sampling not in ("fixed", "poisson"):
            raise ValueError(f"sampling must be 'fixed' or 'poisson', got {self.sampling!r}.")
        self.capacity = None
        if self.sampling == "poisson":
            if not 0.0 < self.client_fraction <= 1.0:
                raise ValueError("Poisson sampling needs client_fraction (q) in (0, 1], got "
                                 f"{self.client_fraction}.")
            from scipy.stats import binom

            n, q = self.train.num_clients, float(self.client_fraction)
            self.capacity = max(int(binom.isf(1e-9, n, q)) + 1, 1) if q < 1 else n

    @property
    def num_clients(self) -> int:
        return self.train.num_clients

    def _poisson_ids(self, rng: np.random.Generator, t: int) -> np.ndarray:
        ids = np.nonzero(rng.random(self.train.num_clients) < self.client_fraction)[0]
        assert self.capacity is not None  # Poisson sampling has one (__post_init__)
        if len(ids) > self.capacity:
            raise RuntimeError(
                f"round {t}: Poisson sampling drew {len(ids)} clients, more than the cohort "
                f"capacity {self.capacity} (probability < 1e-9); rerun with another seed.")
        return ids.astype(np.int64)

    def identity(self) -> dict[str, Any]:
        items = {"client_fraction": self.client_fraction, "local_epochs": self.local_epochs,
                 "batch_size": self.batch_size, "seed": self.seed,
                 # each client's own stream (a checkpoint of the older cohort-wide stream,
                 # which lacks this, is refused: its run would continue on other batches)
                 "shuffles": "per-client"}
        if self.sampling != "fixed":  # absent when fixed: older checkpoints match
            items["sampling"] = self.sampling
        if self.straggler_fraction or self.drop_stragglers:  # absent when off
            items.update(straggler_fraction=self.straggler_fraction,
                         drop_stragglers=self.drop_stragglers)
        train = self.train
        items["train.sha256"] = ckpt.arrays_sha256(train.x, train.y, train.indices,
                                                   train.offsets)
        return items

    def place(self, home):
        features = put_features(self.train.x, home)
        self._table = features.table
        return features.values, jax.device_put(self.train.y.astype(np.int32), home)

    def round_data(self, t: int, pad_to: int) -> RoundData:
        rng = np.random.default_rng([self.seed, t])
        if self.sampling == "poisson":
            ids = self._poisson_ids(rng, t)
        else:
            # in id order, as a networked server stacks its reports
            ids = np.sort(sample_clients(rng, self.train.num_clients, self.client_fraction))
        real = len(ids)
        if real == 0:  # nobody joined: one empty client (n_k = 0, no real steps)
            ids = np.zeros(1, np.int64)
        epochs: int | np.ndarray = self.local_epochs
        if self.straggler_fraction:
            epochs = straggler_epochs(rng, len(ids), self.local_epochs,
                                      self.straggler_fraction)
        cohort = make_cohort(self.train, ids, epochs, self.batch, rng,
                             num_steps=self.num_steps, client_streams=(self.seed, t))
        if self.drop_stragglers and self.straggler_fraction:
            cohort = drop_stragglers(cohort, epochs < self.local_epochs)
        if real == 0:
            cohort = cohort._replace(mask=np.zeros_like(cohort.mask),
                                     num_examples=np.zeros_like(cohort.num_examples))
        if self.capacity is not None:  # a fixed shape for every round
            cohort = pad_cohort(cohort, self.capacity) if len(ids) < self.capacity else cohort
            cohort = Cohort(*(a[:self.capacity] for a in cohort))
        cohort = pad_cohort(cohort, pad_to)
        return RoundData((cohort.idx, cohort.mask), (cohort.num_examples, cohort.client_ids),
                         np.asarray(ids[:real]), real, len(cohort.client_ids),
                         host_steps(cohort.mask))

    def cohort(self, placed, sharded, plain, block_spec) -> CohortBatches:
        x_all, y_all = placed
        idx, mask = sharded
        x = cohort_features(x_all, self._table, idx, block_spec)
        return CohortBatches(Batches(x, take(y_all, idx, block_spec), mask), *plain)


@dataclass
class PopulationSource:
    """Cohorts of a ``VirtualPopulation``: round t samples ``cohort_size`` distinct ids with
    ``sample_cohort`` from ``default_rng([seed, t])``, generates their training data into
    fixed-shape host buffers (``[C · n_max, dim]``, so the round compiles once) and cuts it
    into ``[C, S, B]`` batches (shuffles from the same generator). Nothing of size N."""

    population: VirtualPopulation
    cohort_size: int
    local_epochs: int
    batch_size: float
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.cohort_size, bool) or not isinstance(self.cohort_size, int) \
                or self.cohort_size < 1:
            raise ValueError(f"cohort_size must be a positive int, got {self.cohort_size!r}")
        if self.cohort_size > self.population.num_clients:
            raise ValueError(f"cohort_size={self.cohort_size} > population of "
                             f"{self.population.num_clients}")
        rows = self.population.capacity("train")
        if rows < 1:
            raise ValueError("the population's largest client has no training examples.")
        self.batch, self.num_steps = _steps(rows, self.local_epochs, self.batch_size)

    @property
    def num_clients(self) -> int:
        return self.population.num_clients

    def identity(self) -> dict[str, Any]:
        return {"population": repr(self.population), "cohort_size": self.cohort_size,
                "local_epochs": self.local_epochs, "batch_size": self.batch_size,
                "seed": self.seed}

    def place(self, home):
        del home
        return ()

    def round_data(self, t: int, pad_to: int) -> RoundData:
        rng = np.random.default_rng([self.seed, t])
        ids = sample_cohort(rng, self.population.num_clients, self.cohort_size)
        data = self.population.client_data(ids, "train", fixed_layout=True)
        cohort = make_cohort(data, np.arange(self.cohort_size), self.local_epochs, self.batch,
                             rng, num_steps=self.num_steps)
        cohort = pad_cohort(cohort._replace(client_ids=ids.astype(np.int32)), pad_to)
        plain = (data.x, data.y, cohort.idx, cohort.mask, cohort.num_examples,
                 cohort.client_ids)
        return RoundData((), plain, ids, self.cohort_size, len(cohort.client_ids),
                         host_steps(cohort.mask))

    def cohort(self, placed, sharded, plain, block_spec) -> CohortBatches:
        x, y, idx, mask, num_examples, client_ids = plain
        return CohortBatches(Batches(x[idx], y[idx], mask), num_examples, client_ids)


@dataclass
class HostCohorts:
    """Cohorts made by a function: ``make(t)`` returns round t's cohort as host arrays (a
    ``CohortBatches``, or a ``HyperCohort`` of a training cohort and holdout clients for a
    hypergradient), which the round receives as they are. ``make`` must be a pure function
    of t (checkpoints and resume rely on it); ``identity`` names it for checkpoints."""

    make: Callable[[int], Any]
    num_clients: int
    name: dict[str, Any] = field(default_factory=dict)

    def identity(self) -> dict[str, Any]:
        return dict(self.name)

    def place(self, home):
        del home
        return ()

    def round_data(self, t: int, pad_to: int) -> RoundData:
        cohort = self.make(t)
        train = getattr(cohort, "train", cohort)  # a HyperCohort's training cohort
        size = len(train.num_examples)
        if size % pad_to:
            raise ValueError(f"a cohort of {size} clients does not split over {pad_to} "
                             "devices; make cohorts of a multiple of the device count.")
        real = np.asarray(train.num_examples) > 0
        mask = getattr(getattr(train, "batches", None), "mask", None)
        steps = None if mask is None else host_steps(np.asarray(mask))
        return RoundData((), cohort, np.asarray(train.client_ids)[real], int(real.sum()), size,
                         steps)

    def cohort(self, placed, sharded, plain, block_spec):
        return plain


@dataclass
class HoldoutSource:
    """A ``PartitionSource``'s rounds plus, each round, ``holdout_clients`` clients drawn
    from the whole population with ``default_rng([seed, t, 1])`` (independently of the
    training cohort), each with all its examples in one batch: the ``HyperCohort(train,
    holdout)`` a hypergradient learner's round takes (``fedax.hyper``). The holdout batches
    are gathered from the device-resident training set inside the round."""

    inner: PartitionSource
    holdout_clients: int

    def __post_init__(self):
        n = self.inner.train.num_clients
        if isinstance(self.holdout_clients, bool) or not isinstance(self.holdout_clients, int) \
                or not 1 <= self.holdout_clients <= n:
            raise ValueError(f"holdout_clients must be an int in [1, {n}], got "
                             f"{self.holdout_clients!r}")
        self.width = int(self.inner.train.sizes.max())

    @property
    def num_clients(self) -> int:
        return self.inner.num_clients

    def identity(self) -> dict[str, Any]:
        return {**self.inner.identity(), "holdout_clients": self.holdout_clients}

    def place(self, home):
        return self.inner.place(home)

    def round_data(self, t: int, pad_to: int) -> RoundData:
        data = self.inner.round_data(t, pad_to)
        train = self.inner.train
        rng = np.random.default_rng([self.inner.seed, t, 1])
        ids = np.sort(rng.choice(train.num_clients, self.holdout_clients, replace=False))
        size = -(-len(ids) // pad_to) * pad_to
        idx = np.zeros((size, 1, self.width), np.int64)
        mask = np.zeros((size, 1, self.width), np.float32)
        for c, k in enumerate(ids):
            own = train.client_indices(int(k))
            idx[c, 0, :len(own)] = own
            mask[c, 0, :len(own)] = 1.0
        num = np.zeros(size, np.float32)
        num[:len(ids)] = train.sizes[ids]
        client_ids = np.zeros(size, np.int32)
        client_ids[:len(ids)] = ids
        return data._replace(sharded=(data.sharded, (idx, mask)),
                             plain=(data.plain, (num, client_ids)))

    def cohort(self, placed, sharded, plain, block_spec):
        x_all, y_all = placed
        train = self.inner.cohort(placed, sharded[0], plain[0], block_spec)
        idx, mask = sharded[1]
        x = cohort_features(x_all, self.inner._table, idx, block_spec)
        holdout = CohortBatches(Batches(x, take(y_all, idx, block_spec), mask), *plain[1])
        return HyperCohort(train, holdout)
