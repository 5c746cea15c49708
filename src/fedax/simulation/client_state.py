"""Per-client algorithm state of a population on the host (SCAFFOLD's c_i for up to
millions of clients).

:class:`ClientStateStore` keeps the state as host arrays with leaves ``[N, ...]``, in memory
or in memory-mapped ``.npy`` files, zero until written (the OS materialises a page only when
it is touched). A round gathers the cohort's rows and scatters them back: only the cohort's
part moves. ``fedax.simulation.run(..., client_state=store)`` gathers the cohort's rows
before each round, runs the algorithm's ``cohort_round`` with them, and writes the accepted
clients' new rows back after it.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from fedax.data.virtual_population import _client_ids, _positive_int


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
            mapped = getattr(array, "_mmap", None)  # (numpy's private mapping)
            if isinstance(mapped, mmap.mmap):
                _advise(mapped, "MADV_RANDOM")
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
        # jaxlib ships no stub for PyTreeDef (its flatten_up_to is real)
        leaves = self.treedef.flatten_up_to(values)  # type: ignore[attr-defined]
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
