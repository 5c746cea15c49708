"""Facts about the host and XLA's options for it, shared by the runner, the execution
strategies and the ``processes`` workers (a leaf module: it imports nothing of fedax)."""

from __future__ import annotations

import os

import jax


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity mask; all cores where the OS
    has no affinity API)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


CPU_DOTS = ("eigen", "ynn")


def compiler_options(backend: str | None = None) -> dict[str, str] | None:
    """XLA compiler options for a compiled round on ``backend`` (default: JAX's default).

    On CPU, matrix products are left to XLA's own (Eigen) kernels instead of YNNPACK's,
    which XLA:CPU picks by default; YNNPACK keeps its reduction fusions. Measured on a
    2-core AVX2 machine (``benchmarks/bench_cpu_dots.py``): the MNIST CNN's local step
    ran faster with Eigen products, the 2NN's about the same. Numbers differ from YNNPACK
    products only in float rounding. ``$FEDAX_CPU_DOTS=ynn`` restores XLA's default
    (``eigen`` is the default). None on other backends.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return None
    dots = os.environ.get("FEDAX_CPU_DOTS", "eigen")
    if dots not in CPU_DOTS:
        raise ValueError(f"FEDAX_CPU_DOTS={dots!r} is not one of {CPU_DOTS}.")
    if dots == "ynn":
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
