"""Populations of up to millions of clients: data made on demand, per-client state on the host.

``fedax.simulation.run`` holds the whole training set on the device and, for SCAFFOLD, every
client's c_i in the algorithm state: memory grows with the population N. Here nothing of
size N is ever materialised, on the host or on the device:

* :class:`VirtualPopulation`: N clients whose data is a pure function of (seed, client id),
  generated when the client is sampled (Synthetic(α, β)-style), so a round costs O(cohort).
* :class:`ClientStateStore`: per-client algorithm state (SCAFFOLD's c_i) as host arrays with
  leaves ``[N, ...]``, in memory or in memory-mapped ``.npy`` files, zero until written
  (the OS materialises a page only when it is touched). A round gathers the cohort's rows
  and scatters them back: only the cohort's part moves.
* :func:`sample_cohort`: C distinct ids out of N in O(C) time and memory (Floyd's
  algorithm), where ``rng.choice(N, C, replace=False)`` is O(N).
* :func:`run_population`: the runner for this mode. Each round generates the cohort's data
  on the host into fixed-shape buffers (``[C · n_max, dim]`` with n_max the most training
  examples a client can have, so the round compiles once), cuts it into ``[C, S, B]``
  batches with :func:`fedax.data.make_cohort`, and runs one compiled round. Device memory
  is O(C · n_max · dim + model), independent of N.

SCAFFOLD runs with its c_i in a store through ``scaffold(..., cohort_slots=C)``: the
algorithm state then holds C slots, one per cohort position, which the runner fills from
the store before each round and reads back after. Same SCAFFOLD code; the c-update still
divides by N.

Seeding matches ``fedax.simulation.run``: round t draws its cohort and the clients'
shuffles from ``np.random.default_rng([seed, t])`` and its JAX key from
``fold_in(key(seed), t)``. The population's data has its own seed.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from fedax.algorithms import CohortBatches, FederatedAlgorithm
from fedax.client import Batches
from fedax.data import ClientData, make_cohort, num_local_steps
from fedax.data.synthetic import COV_EXPONENT, SIZE_LOG_MEAN, SIZE_LOG_SIGMA, SIZE_OFFSET
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.host import compiler_options
from fedax.simulation.runner import Callback, History, _maybe_mesh, _pad_cohort

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


# ----------------------------------------------------------------------------- client state


def _advise(buffer: mmap.mmap, name: str) -> None:
    advice = getattr(mmap, name, None)  # Linux only; elsewhere a no-op
    if advice is not None and hasattr(buffer, "madvise"):
        buffer.madvise(advice)


def _lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero array in anonymous memory that the OS fills a 4 KiB page at a time on first
    touch. ``np.zeros`` is lazy too, but with transparent huge pages on (``always``) each
    first touch zero-fills 2 MiB: a cohort's 1,000 scattered rows of a 1M-client table
    materialised ~2 GiB and took seconds."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    _advise(buffer, "MADV_NOHUGEPAGE")
    return np.frombuffer(buffer, dtype, count=count).reshape(shape)


class ClientStateStore:
    """Per-client state of a population on the host: a pytree whose leaves are ``[N, ...]``.

    ``template`` gives one client's state (a pytree of arrays or ``jax.ShapeDtypeStruct``);
    every client starts at zero. With ``directory=None`` the leaves are NumPy arrays in
    anonymous memory, zero-filled by the OS a 4 KiB page at a time on first touch (huge
    pages off), so untouched clients cost no memory; with a directory, each leaf is a
    memory-mapped ``.npy`` file ``leaf_<i>.npy`` there (created sparse, or reopened with
    ``mode="r+"``; read-ahead off, as rows are read at random), read and written a
    cohort's rows at a time through the OS page cache.

    Args:
      template: One client's state.
      num_clients: N.
      directory: None (memory) or where the ``.npy`` files live.
      mode: ``"w+"`` creates (overwrites) the files; ``"r+"`` opens existing ones, which
        must match the template's shapes and dtypes.
    """

    def __init__(
        self,
        template: Any,
        num_clients: int,
        directory: str | os.PathLike[str] | None = None,
        mode: Literal["w+", "r+"] = "w+",
    ):
        self.num_clients = _positive_int(num_clients, "num_clients")
        leaves, self.treedef = jax.tree.flatten(template)
        if not leaves:
            raise ValueError("the state template has no array leaves")
        self.shapes = [tuple(np.shape(leaf)) for leaf in leaves]
        self.dtypes = [np.dtype(leaf.dtype) for leaf in leaves]
        self.directory = None if directory is None else Path(directory)
        if mode not in ("w+", "r+"):
            raise ValueError(f"mode must be 'w+' or 'r+', got {mode!r}")
        self.arrays: list[np.ndarray] = []
        if self.directory is not None and mode == "w+":
            self.directory.mkdir(parents=True, exist_ok=True)
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes, strict=True)):
            full = (self.num_clients, *shape)
            if self.directory is None:
                self.arrays.append(_lazy_zeros(full, dtype))
                continue
            path = self.directory / f"leaf_{i}.npy"
            array = np.lib.format.open_memmap(
                path, mode=mode, dtype=dtype, shape=full if mode == "w+" else None
            )
            if array.shape != full or array.dtype != dtype:
                raise ValueError(
                    f"{path} holds {array.dtype} {array.shape}, the template needs {dtype} {full}"
                )
            if isinstance(getattr(array, "_mmap", None), mmap.mmap):
                _advise(array._mmap, "MADV_RANDOM")
            self.arrays.append(array)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole table (what an on-device ``[N, ...]`` state would take)."""
        return sum(a.nbytes for a in self.arrays)

    def gather(self, ids) -> Any:
        """The given clients' state: a pytree of NumPy arrays ``[len(ids), ...]`` (copies)."""
        ids = _client_ids(ids, self.num_clients)
        return jax.tree.unflatten(self.treedef, [np.asarray(a[ids]) for a in self.arrays])

    def scatter(self, ids, values: Any) -> None:
        """Set the given (distinct) clients' state to ``values``, leaves ``[len(ids), ...]``."""
        ids = _client_ids(ids, self.num_clients)
        if len(np.unique(ids)) != len(ids):
            raise ValueError("scatter needs distinct client ids")
        leaves = self.treedef.flatten_up_to(values)
        for array, value, shape in zip(self.arrays, leaves, self.shapes, strict=True):
            value = np.asarray(value)
            if value.shape != (len(ids), *shape):
                raise ValueError(f"values leaf {value.shape} != {(len(ids), *shape)}")
            array[ids] = value

    def flush(self) -> None:
        """Write memory-mapped leaves to disk (a no-op in memory)."""
        for array in self.arrays:
            if isinstance(array, np.memmap):
                array.flush()


# ----------------------------------------------------------------------------- runner


@dataclass
class PopulationHistory(History):
    """A ``History`` plus ``round_times``: wall seconds of each round, from the end of the
    previous round (or the start) to the moment its results are back on the host,
    evaluation excluded. It includes sampling and generating the *next* cohort, which
    overlaps with the device's work on this one (except in the last round); round 1
    includes compilation."""

    round_times: list[float] = dataclasses.field(default_factory=list)


def run_population(
    algorithm: FederatedAlgorithm,
    init_params: Any,
    population: VirtualPopulation,
    evaluate: Callable[[Any], tuple[float, float]] | None,
    *,
    rounds: int,
    cohort_size: int,
    local_epochs: int,
    batch_size: float,
    seed: int = 0,
    client_state: ClientStateStore | None = None,
    client_state_field: str = "client_controls",
    eval_every: int = 1,
    execution: Execution | None = None,
    callbacks: Sequence[Callback] = (),
) -> PopulationHistory:
    """Run ``rounds`` rounds of ``algorithm`` on a virtual population, cohort by cohort.

    Round t samples ``cohort_size`` distinct clients with :func:`sample_cohort` from
    ``np.random.default_rng([seed, t])``, generates their training data into fixed-shape
    host buffers, cuts it into ``[C, S, B]`` batches with ``make_cohort`` (shuffles from the
    same generator; S covers the largest possible client), and runs one compiled round with
    key ``fold_in(key(seed), t)``: the round compiles once. The next cohort is prepared
    while the device works.

    Per-client state: with ``client_state`` (a :class:`ClientStateStore` of N rows), the
    algorithm's state field ``client_state_field`` must be a slot buffer with one row per
    cohort position, e.g. ``scaffold(loss, lr, N, cohort_slots=C)`` with C the cohort size
    rounded up to a multiple of ``execution.devices``. Before each round the runner puts
    the cohort's rows from the store into the slots; after it, it writes the slots of the
    clients with training data back. Without a store the algorithm keeps whatever state it
    keeps (on-device SCAFFOLD works, with O(N) device memory).

    Args:
      algorithm: A ``FederatedAlgorithm``.
      init_params: The initial server model.
      population: The clients.
      evaluate: ``evaluate(params) -> (accuracy, loss)``, or None to record only the
        training loss (e.g. a test set from ``population.client_data(ids, "test")`` and
        ``make_evaluator``).
      rounds, cohort_size, local_epochs, batch_size: T, C, E and B (``math.inf``: the full
        local data set in one step per epoch).
      seed: The run's randomness (cohorts, shuffles, keys).
      client_state: Host store of per-client state, or None.
      client_state_field: Name of the state field holding the slot buffer.
      eval_every: Record (and evaluate) after every k-th round and after the last one.
      execution: Execution strategy; default ``choose_execution()``.
      callbacks: Each is called with every record.

    Returns:
      A :class:`PopulationHistory` with the records, the final state and per-round times.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}.")
    cohort_size = _positive_int(cohort_size, "cohort_size")
    if cohort_size > population.num_clients:
        raise ValueError(f"cohort_size={cohort_size} > population of {population.num_clients}")
    if client_state is not None and client_state.num_clients != population.num_clients:
        raise ValueError(
            f"the client state store has {client_state.num_clients} rows, "
            f"the population {population.num_clients} clients."
        )
    execution = execution or choose_execution()
    rows = population.capacity("train")
    if rows < 1:
        raise ValueError("the population's largest client has no training examples.")
    # Fixed shapes for every round: B = ∞ is one batch of the largest possible client.
    batch = rows if math.isinf(batch_size) else int(batch_size)
    num_steps = num_local_steps(rows, local_epochs, batch)
    mesh = execution.mesh()
    pad_to = execution.devices
    slots = -(-cohort_size // pad_to) * pad_to

    def prepare(t: int):
        rng = np.random.default_rng([seed, t])
        ids = sample_cohort(rng, population.num_clients, cohort_size)
        data = population.client_data(ids, "train", fixed_layout=True)
        cohort = make_cohort(
            data, np.arange(cohort_size), local_epochs, batch, rng, num_steps=num_steps
        )
        cohort = _pad_cohort(cohort._replace(client_ids=ids.astype(np.int32)), pad_to)
        return ids, data.x, data.y, cohort

    def device_round(state, x, y, idx, mask, num_examples, client_ids, key):
        batches = Batches(x[idx], y[idx], mask)
        return algorithm.round(state, CohortBatches(batches, num_examples, client_ids), key)

    def slot_leaves(state):
        if not hasattr(state, client_state_field):
            raise ValueError(
                f"client_state needs an algorithm state with a {client_state_field!r} field; "
                f"got {type(state).__name__}."
            )
        return getattr(state, client_state_field)

    with use_execution(execution), _maybe_mesh(mesh):
        # Compiled with the runner's XLA options (compiler_options), as every fedax round.
        round_fn = jax.jit(device_round, donate_argnums=(0,),
                           compiler_options=compiler_options())
        base_key = jax.random.key(seed)
        state = algorithm.init(init_params, jax.random.fold_in(base_key, -1 & 0x7FFFFFFF))
        if mesh is not None:
            home = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        else:
            home = jax.devices()[0]
        state = jax.device_put(state, home)
        if client_state is not None:
            expected = [(slots, *shape) for shape in client_state.shapes]
            got = [tuple(np.shape(a)) for a in jax.tree.leaves(slot_leaves(state))]
            if got != expected:
                raise ValueError(
                    f"state.{client_state_field} has leaves {got}; with this store and "
                    f"cohort it must be {expected} (one slot per cohort position, e.g. "
                    f"scaffold(..., cohort_slots={slots}))."
                )
        history = PopulationHistory()
        start = mark = time.perf_counter()
        ahead = prepare(0)
        for t in range(rounds):
            ids, x, y, cohort = ahead
            if client_state is not None:
                values = client_state.gather(ids)
                if slots > cohort_size:
                    values = jax.tree.map(
                        lambda v: np.concatenate(
                            [v, np.zeros((slots - cohort_size, *v.shape[1:]), v.dtype)]
                        ),
                        values,
                    )
                state = state._replace(**{client_state_field: jax.device_put(values, home)})
            state, metrics = round_fn(
                state,
                x,
                y,
                cohort.idx,
                cohort.mask,
                cohort.num_examples,
                cohort.client_ids,
                jax.random.fold_in(base_key, t),
            )
            if t + 1 < rounds:
                ahead = prepare(t + 1)  # host work overlapping the device's
            if client_state is not None:
                active = cohort.num_examples[:cohort_size] > 0
                values = [
                    np.asarray(v)[:cohort_size][active]
                    for v in jax.device_get(jax.tree.leaves(slot_leaves(state)))
                ]
                client_state.scatter(ids[active], jax.tree.unflatten(client_state.treedef, values))
            train_loss = float(metrics["train_loss"])
            now = time.perf_counter()
            history.round_times.append(now - mark)
            if (t + 1) % eval_every == 0 or t + 1 == rounds:
                record: dict[str, Any] = {"round": t + 1, "train_loss": train_loss}
                if evaluate is not None:
                    acc, loss = evaluate(algorithm.server_params(state))
                    record["test_accuracy"], record["test_loss"] = acc, loss
                record["elapsed_s"] = time.perf_counter() - start
                history.records.append(record)
                for callback in callbacks:
                    callback(record)
                if not math.isfinite(train_loss):
                    raise FloatingPointError(
                        f"round {t + 1}: the model diverged (train loss {train_loss})."
                    )
            mark = time.perf_counter()
    history.state = state
    return history
