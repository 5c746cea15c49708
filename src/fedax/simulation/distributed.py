"""Several processes, one run: JAX's own distributed runtime (``jax.distributed``).

A simulation spread over processes (on one machine, or one process per host of a cluster)
is the same program as on one process: every process runs the same runner with the same
config and seed, builds the same cohorts on its host, and calls the same compiled round;
the device mesh ``clients`` spans every device of every process, so each process computes
its own block of clients and the federated sums become cross-process collectives (Gloo on
CPU, NCCL on GPU). Nothing else changes: ``jax.device_put`` of a host value to a global
sharding gives each process its own shards, and the round's outputs (the state, the
metrics) are replicated, so every process reads them.

Start every process with :func:`initialize` before anything else touches JAX:

    initialize("10.0.0.1:29500", num_processes=2, process_id=0)   # on host 0
    initialize("10.0.0.1:29500", num_processes=2, process_id=1)   # on host 1

(``fedax run CONFIG --num-processes N`` does this for N processes on one machine;
``docs/scaling.md``). Process 0 is the primary: it is the one whose outputs count (the
others write their identical copies where they are told to).
"""

from __future__ import annotations

import re

_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def initialize(coordinator: str, num_processes: int, process_id: int,
               *, timeout_s: int = 120) -> None:
    """Join the run's processes through the coordinator at ``coordinator`` (``host:port``;
    process 0 listens there). On CPU the collectives are Gloo's (JAX's default on CPU has
    none across processes). Raises ``ValueError`` with a fix for a malformed request."""
    if not isinstance(coordinator, str) or not _ADDRESS.match(coordinator):
        raise ValueError(f"coordinator must be HOST:PORT (process 0's address), got "
                         f"{coordinator!r}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) \
            or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if isinstance(process_id, bool) or not isinstance(process_id, int) \
            or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id!r}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)


def process_count() -> int:
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """Whether this process's outputs are the run's (process 0, or the only process)."""
    import jax

    return jax.process_index() == 0


def check_mesh(mesh) -> None:
    """A multi-process run needs a ``clients`` mesh over devices of every process (a
    value on one process's device is not addressable from the others): ``ValueError``
    naming the fix otherwise. One process: nothing to check."""
    import jax

    if jax.process_count() == 1:
        return
    if mesh is None:
        raise ValueError(
            f"a run over {jax.process_count()} processes needs the cohort split over the "
            f"devices of every process: execution.devices = {jax.device_count()} (every "
            "device) and a built-in strategy (sequential, vmap), not one device or "
            "'processes'")
    owners = {d.process_index for d in mesh.devices.flat}
    if len(owners) != jax.process_count():
        raise ValueError(
            f"the clients mesh covers the devices of processes {sorted(owners)} only, of "
            f"{jax.process_count()}: set execution.devices = {jax.device_count()} (every "
            "device of every process)")
