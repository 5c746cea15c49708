"""The ``processes`` execution strategy: clients run in worker processes, one per core.

On a multi-core CPU, XLA devices in one process share one intra-op thread pool, and two of
them scale only about 1.3x on two cores; two separate single-threaded processes scale
about 1.9x (measured, ``docs/scaling.md``). This strategy keeps the round one compiled
program in the calling process and sends only the client map out:

* while the round is traced, ``map_clients(f, *xs)`` traces ``f`` for one client, hoists
  the traced values it closes over into explicit arguments, and exports (``jax.export``)
  a program that runs a block of ``b`` clients one after another (``lax.map``);
* the round calls back (``jax.pure_callback``) with the clients' inputs; the callback
  splits the cohort into one block per worker, of near-equal local steps when the cohort
  divides evenly (the clients dealt by steps, as devices are: ``fedax.federated._lockstep``),
  else contiguous (the last padded by repeating its last client, whose outputs are
  dropped), writes each block into shared memory, and the
  workers, each a JAX runtime pinned to its own core, run the exported program on it. An
  input that ``fed.broadcast`` placed at the clients (the model) is sent once per worker,
  as the server value, not once per client;
* the outputs are stacked back in client order and the round goes on (aggregation and
  the server update run in the calling process).

The numbers equal the ``sequential`` strategy's up to float rounding (the client program
is compiled on its own instead of inside the round). A worker compiles each exported
program once and keeps it. Nothing is pickled: requests are JSON headers and raw bytes.

The client map is not differentiable under this strategy (it leaves the JAX program);
differentiate rounds under ``sequential`` or ``vmap``.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from fedax.federated import _lockstep
from fedax.federated._primitives import broadcast_source
from fedax.simulation._client_worker import read_message, write_message
from fedax.simulation.host import cpu_dots, usable_cores

_ALIGN = 64


def _layout(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[list], int]:
    """Offsets (64-byte aligned) of arrays of the given (shape, dtype) in one buffer, as
    ``[offset, dtype, shape]`` per array, and the buffer's size."""
    leaves, offset = [], 0
    for shape, dtype in specs:
        dtype = np.dtype(dtype)
        leaves.append([offset, dtype.str, list(shape)])
        offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return leaves, max(offset, _ALIGN)


class _Worker:
    """One worker process and the shared-memory segments it reads and writes."""

    def __init__(self, core: int):
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedax.simulation._client_worker",
             str(core), str(child_r), str(child_w)],
            pass_fds=(child_r, child_w), env=env, stdin=subprocess.DEVNULL,
        )
        os.close(child_r)
        os.close(child_w)
        self.rfd, self.wfd = parent_r, parent_w
        self.loaded: set[str] = set()
        self.segments: dict[str, shared_memory.SharedMemory | None] = {"in": None, "out": None}
        self.hello = self.reply()

    def send(self, header: dict, payload: bytes = b"") -> None:
        try:
            write_message(self.wfd, header, payload)
        except OSError as err:
            raise self._exited() from err

    def _exited(self) -> RuntimeError:
        try:
            status = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        return RuntimeError(
            f"fedax client worker (pid {self.proc.pid}) exited (status {status}); its "
            "error, if any, is on stderr above. The pool starts fresh workers on next use."
        )

    def reply(self) -> dict:
        try:
            header, _ = read_message(self.rfd)
        except (EOFError, OSError) as err:
            raise self._exited() from err
        if not header.get("ok"):
            raise RuntimeError(f"fedax client worker failed:\n{header.get('error')}")
        return header

    def segment(self, which: str, size: int) -> shared_memory.SharedMemory:
        shm = self.segments[which]
        if shm is None or shm.size < size:
            if shm is not None:
                shm.close()
                shm.unlink()
            shm = shared_memory.SharedMemory(create=True, size=size)
            self.segments[which] = shm
        return shm

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                write_message(self.wfd, {"op": "exit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        for fd in (self.rfd, self.wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        for shm in self.segments.values():
            if shm is not None:
                shm.close()
                shm.unlink()
        self.segments = {"in": None, "out": None}


class ClientProcesses:
    """A pool of client worker processes that executes ``map_clients``.

    Pass it to ``fedax.federated.map_strategy`` (the runner does, for
    ``Execution(map="processes")``). ``workers`` processes are started on first use, worker
    i pinned to core ``cores[i]`` (default: the cores this process may run on); they live
    until ``close()`` or interpreter exit.
    """

    def __init__(self, workers: int | None = None, cores: Sequence[int] | None = None):
        available = usable_cores()
        self.cores = list(cores) if cores is not None else available
        self.num_workers = workers or len(self.cores)
        if self.num_workers < 1:
            raise ValueError(f"ClientProcesses needs at least one worker, got {workers}.")
        self._workers: list[_Worker] = []
        # key -> (serialized program, the product kernels it compiles with: host.cpu_dots)
        self._programs: dict[str, tuple[bytes, str]] = {}
        self._lock = threading.Lock()
        # The last round's seconds (sending the blocks, each worker's run, the whole call)
        # and the bytes of each worker's inputs.
        self.last_timing: dict[str, Any] = {}

    # ---- process management -----------------------------------------------------------

    def _start(self) -> list[_Worker]:
        if not self._workers:
            self._workers = [_Worker(self.cores[i % len(self.cores)])
                             for i in range(self.num_workers)]
        return self._workers

    def close(self) -> None:
        """Stops the workers, after the round they are running (if any) has finished."""
        # The round's callback runs on an XLA thread and holds the lock while it uses the
        # workers (e.g. while the main thread handles Ctrl-C); a hung one is not waited for.
        locked = self._lock.acquire(timeout=60)
        try:
            for worker in self._workers:
                worker.close()
            self._workers = []
        finally:
            if locked:
                self._lock.release()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # ---- the client map ---------------------------------------------------------------

    def map_clients(self, f: Callable[..., Any], xs: tuple) -> Any:
        """``out[i] = f(*[x[i] for x in xs])``, traced as a callback to the workers."""
        n = jax.tree.leaves(xs)[0].shape[0]
        workers = min(self.num_workers, n)
        block = math.ceil(n / workers)
        workers = math.ceil(n / block)

        flat_xs, xs_tree = jax.tree.flatten(xs)
        keys = [jnp.issubdtype(a.dtype, jax.dtypes.prng_key) for a in flat_xs]
        impls = [jax.random.key_impl(a) if k else None for a, k in zip(flat_xs, keys, strict=True)]
        flat_xs = [jax.random.key_data(a) if k else a for a, k in zip(flat_xs, keys, strict=True)]

        # Broadcast inputs travel once per worker as their server value; at least one input
        # stays per client (it carries the block's length).
        sources = [None if k else broadcast_source(a)
                   for a, k in zip(jax.tree.leaves(xs), keys, strict=True)]
        if all(src is not None for src in sources):
            sources[0] = None
        shared = [i for i, src in enumerate(sources) if src is not None]
        per_client = [i for i, src in enumerate(sources) if src is None]

        def one_client(*flat):
            leaves = [jax.random.wrap_key_data(a, impl=i) if k else a
                      for a, k, i in zip(flat, keys, impls, strict=True)]
            return f(*jax.tree.unflatten(xs_tree, leaves))

        example = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in flat_xs]
        closed, out_shape = jax.make_jaxpr(one_client, return_shape=True)(*example)
        out_flat, out_tree = jax.tree.flatten(out_shape)
        if any(jnp.issubdtype(o.dtype, jax.dtypes.prng_key) for o in out_flat):
            raise TypeError("map_clients under 'processes' cannot return PRNG key arrays.")
        # Values the client program closes over: traced ones (from the round being traced)
        # become arguments of the exported program; concrete ones stay inside it.
        hoist = [isinstance(c, jax.core.Tracer) for c in closed.consts]
        hoisted = [c for c, h in zip(closed.consts, hoist, strict=True) if h]
        jaxpr = closed.jaxpr

        def block_program(*args):
            # flat: the hoisted values, the shared server values, the clients' own inputs
            consts = args[: len(hoisted)]
            values = args[len(hoisted) : len(hoisted) + len(shared)]
            block_xs = args[len(hoisted) + len(shared) :]
            it = iter(consts)
            merged = [next(it) if h else c for c, h in zip(closed.consts, hoist, strict=True)]
            run_one = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, merged))

            def client(own):
                leaves = [None] * len(flat_xs)
                for i, v in zip(shared, values, strict=True):
                    leaves[i] = v
                for i, v in zip(per_client, own, strict=True):
                    leaves[i] = v
                return tuple(run_one(*leaves))

            return jax.lax.map(client, tuple(block_xs))

        server_values = [sources[i] for i in shared]
        const_avals = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in hoisted + server_values]
        block_avals = [jax.ShapeDtypeStruct((block, *flat_xs[i].shape[1:]), flat_xs[i].dtype)
                       for i in per_client]
        # Exported while the round is traced: the local-steps strategy in force applies.
        exported = jax.export.export(jax.jit(block_program), platforms=("cpu",))(
            *const_avals, *block_avals
        )
        program = bytes(exported.serialize())
        # The workers compile it with the product kernels in force here and now.
        dots = cpu_dots()
        key = hashlib.sha256(program + dots.encode()).hexdigest()
        self._programs[key] = (program, dots)

        result_shapes = [jax.ShapeDtypeStruct((n, *o.shape), o.dtype) for o in out_flat]

        def host(consts, block_inputs):
            return self._run(key, workers, block, n, consts, block_inputs, result_shapes)

        # Workers get blocks of near-equal steps, not contiguous ones (as devices do:
        # fedax.federated._lockstep); outputs come back in cohort order.
        steps = _lockstep.client_steps(xs) if _lockstep.balancing() else None
        own = [flat_xs[i] for i in per_client]
        perm = None
        if steps is not None and workers > 1 and n % workers == 0:
            perm = _lockstep.balanced_permutation(steps, workers)
            own = [jnp.take(a, perm, axis=0) for a in own]
        outs = _not_differentiable(host, result_shapes, list(hoisted) + server_values, own)
        if perm is not None:
            back = _lockstep.inverse(perm)
            outs = [jnp.take(o, back, axis=0) for o in outs]
        return jax.tree.unflatten(out_tree, outs)

    def _run(self, key, workers, block, n, consts, inputs, result_shapes):
        try:
            return self._run_blocks(key, workers, block, n, consts, inputs, result_shapes)
        except BaseException:
            self.close()  # a failed or interrupted round leaves no half-used workers
            raise

    def _run_blocks(self, key, workers, block, n, consts, inputs, result_shapes):
        consts = [np.asarray(c) for c in consts]
        inputs = [np.asarray(a) for a in inputs]
        with self._lock:
            start = time.perf_counter()
            pool = self._start()[:workers]
            for worker in pool:
                if key not in worker.loaded:
                    program, dots = self._programs[key]
                    worker.send({"op": "load", "key": key, "dots": dots}, program)
            for worker in pool:
                if key not in worker.loaded:
                    worker.reply()
                    worker.loaded.add(key)
            # Every worker's inputs and outputs have the same layouts: the shared values and
            # a block of clients each.
            in_leaves, in_size = _layout([(c.shape, c.dtype) for c in consts]
                                         + [((block, *a.shape[1:]), a.dtype) for a in inputs])
            out_leaves, out_size = _layout([((block, *r.shape[1:]), r.dtype)
                                            for r in result_shapes])
            for w, worker in enumerate(pool):
                lo, hi = w * block, min(n, (w + 1) * block)
                rows = np.minimum(np.arange(lo, lo + block), hi - 1)  # pad: repeat the last
                block_in = consts + [a[lo:hi] if hi - lo == block else a[rows] for a in inputs]
                shm_in = worker.segment("in", in_size)
                for (offset, _, _), a in zip(in_leaves, block_in, strict=True):
                    np.ndarray(a.shape, a.dtype, buffer=shm_in.buf, offset=offset)[...] = a
                shm_out = worker.segment("out", out_size)
                worker.send({
                    "op": "run", "key": key,
                    "in": {"name": shm_in.name, "leaves": in_leaves},
                    "out": {"name": shm_out.name, "leaves": out_leaves},
                })
            results: list[list[np.ndarray]] = [[] for _ in result_shapes]
            self.last_timing = {"send_s": time.perf_counter() - start, "workers_s": [],
                                "in_bytes": [in_size] * len(pool)}
            for w, worker in enumerate(pool):
                self.last_timing["workers_s"].append(worker.reply()["seconds"])
                real = min(n, (w + 1) * block) - w * block  # the block's clients, no padding
                segment = worker.segments["out"]
                assert segment is not None  # made for this round (worker.segment above)
                buf = segment.buf
                for i, (offset, dtype, shape) in enumerate(out_leaves):
                    view = np.ndarray(tuple(shape), np.dtype(dtype), buffer=buf, offset=offset)
                    results[i].append(view[:real])
            # One copy out of shared memory, before the lock lets the next round reuse it.
            out = [np.concatenate(r, axis=0) for r in results]
            self.last_timing["total_s"] = time.perf_counter() - start
        return out


def _not_differentiable(host, result_shapes, consts, inputs):
    @jax.custom_jvp
    def call(consts, inputs):
        return jax.pure_callback(host, result_shapes, consts, inputs,
                                 vmap_method="sequential")

    @call.defjvp
    def _jvp(primals, tangents):
        raise TypeError(
            "map_clients ran under the 'processes' execution strategy, whose client "
            "programs run in worker processes outside the JAX program, so it cannot be "
            "differentiated. Differentiate rounds under Execution(map='sequential') or "
            "'vmap' (the same numbers)."
        )

    return call(consts, inputs)


_POOLS: dict[tuple[int, tuple[int, ...] | None], ClientProcesses] = {}


def client_processes(workers: int | None = None,
                     cores: Sequence[int] | None = None) -> ClientProcesses:
    """The shared pool for ``(workers, cores)``: started once, reused by every run."""
    key = (workers or 0, tuple(cores) if cores is not None else None)
    if key not in _POOLS:
        _POOLS[key] = ClientProcesses(workers, cores)
    return _POOLS[key]


@atexit.register
def close_pools() -> None:
    """Stops every shared pool's workers (they start again on next use). Runs at exit;
    the ``fedax`` command also calls it on Ctrl-C, when the workers (which ignore SIGINT,
    see ``_client_worker``) are still waiting for work."""
    for pool in _POOLS.values():
        pool.close()
