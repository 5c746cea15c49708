"""Facts about the host and XLA's options for it, shared by the runner, the execution
strategies and the ``processes`` workers (a leaf module: it imports nothing of fedax)."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity mask; all cores where the OS
    has no affinity API)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


CPU_DOTS = ("eigen", "ynn")


# XLA:CPU product kernels per model (``fedax run``'s model names) where fedax measured one
# faster than its default: the char-LSTM's small in-loop products run about 10% faster with
# YNNPACK's (benchmarks/bench_lstm.py, fedax against fedax-eigen).
MODEL_CPU_DOTS = {"char_lstm": "ynn"}

def cpu_dots_for(model: str | None, precision: str = "float32") -> str | None:
    """The product kernels fedax prefers for ``model`` (a ``fedax run`` model name) at
    ``precision``: YNNPACK for bfloat16 (Eigen's bfloat16 products are several times
    slower), :data:`MODEL_CPU_DOTS` otherwise; None: fedax's default."""
    if precision == "bfloat16":
        return "ynn"
    return MODEL_CPU_DOTS.get(model) if model is not None else None


_PREFERRED_CPU_DOTS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fedax_preferred_cpu_dots", default=None)


@contextlib.contextmanager
def preferred_cpu_dots(dots: str | None) -> Iterator[None]:
    """Within the block, rounds compiled on CPU use ``dots`` (one of :data:`CPU_DOTS`; None:
    fedax's default) unless ``$FEDAX_CPU_DOTS`` says otherwise. The experiments layer sets
    it per model where it measured a difference."""
    if dots is not None and dots not in CPU_DOTS:
        raise ValueError(f"dots={dots!r} is not one of {CPU_DOTS}.")
    token = _PREFERRED_CPU_DOTS.set(dots)
    try:
        yield
    finally:
        _PREFERRED_CPU_DOTS.reset(token)


def cpu_dots() -> str:
    """The product kernels a CPU round compiles with now: ``$FEDAX_CPU_DOTS``, else the
    :func:`preferred_cpu_dots` in force, else ``eigen``."""
    dots = os.environ.get("FEDAX_CPU_DOTS") or _PREFERRED_CPU_DOTS.get() or "eigen"
    if dots not in CPU_DOTS:
        raise ValueError(f"FEDAX_CPU_DOTS={dots!r} is not one of {CPU_DOTS}.")
    return dots


def compiler_options(backend: str | None = None, dots: str | None = None
                     ) -> dict[str, str | bool] | None:
    """XLA compiler options for a compiled round on ``backend`` (default: JAX's default).

    On CPU, matrix products are left to XLA's own (Eigen) kernels instead of YNNPACK's,
    which XLA:CPU picks by default; YNNPACK keeps its reduction fusions. Measured on a
    2-core AVX2 machine (``benchmarks/bench_cpu_dots.py``): the MNIST CNN's local step
    ran faster with Eigen products, the 2NN's about the same; the char-LSTM's step about
    10% slower (``benchmarks/bench_lstm.py``: its in-loop ``[B, H] x [H, 4H]`` products),
    and bfloat16 products (``precision: bfloat16``) several times slower, so
    :func:`preferred_cpu_dots` selects YNNPACK for those. Numbers differ between the two
    only in float rounding. ``dots`` (``eigen`` or ``ynn``; default :func:`cpu_dots`, which
    ``$FEDAX_CPU_DOTS`` overrides) chooses explicitly, as the ``processes`` workers do with
    their parent's choice. None on other backends.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return None
    dots = dots or cpu_dots()
    if dots not in CPU_DOTS:
        raise ValueError(f"dots={dots!r} is not one of {CPU_DOTS}.")
    if dots == "ynn":
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


def cpu_has_bf16() -> bool:
    """Whether this host's CPU has bfloat16 arithmetic (x86: AVX512-BF16 or AMX-BF16, from
    ``/proc/cpuinfo``; Arm: the BF16 extension). False where that cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
