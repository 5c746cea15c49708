"""XLA:CPU compiler options: fedax's product-kernel default, the per-model preference and the
``$FEDAX_CPU_DOTS`` override (``fedax.simulation.host``)."""

import pytest

from fedax.simulation.host import compiler_options, preferred_cpu_dots

EIGEN = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


def test_default_preference_and_override(monkeypatch):
    monkeypatch.delenv("FEDAX_CPU_DOTS", raising=False)
    assert compiler_options("cpu") == EIGEN  # fedax's CPU default: XLA's own products
    assert compiler_options("gpu") is None
    with preferred_cpu_dots("ynn"):
        assert compiler_options("cpu") is None  # XLA's default (YNNPACK products)
        monkeypatch.setenv("FEDAX_CPU_DOTS", "eigen")
        assert compiler_options("cpu") == EIGEN  # the environment wins
        monkeypatch.delenv("FEDAX_CPU_DOTS")
        with preferred_cpu_dots(None):
            assert compiler_options("cpu") == EIGEN
        assert compiler_options("cpu") is None
    assert compiler_options("cpu") == EIGEN  # restored on leaving the block


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="not one of"), preferred_cpu_dots("mkl"):
        pass
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDAX_CPU_DOTS", "fast")
        with pytest.raises(ValueError, match="FEDAX_CPU_DOTS='fast'"):
            compiler_options("cpu")


def test_collective_patience_flags():
    from fedax.cli.processes import COLLECTIVE_PATIENCE, with_collective_patience

    flags = with_collective_patience("--xla_force_host_platform_device_count=2")
    for name, value in COLLECTIVE_PATIENCE.items():
        assert f"--{name}={value}" in flags.split()
    assert value >= 600
    mine = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1"
    kept = with_collective_patience(mine)
    assert mine in kept.split() and kept.count("warn_stuck") == 1


_IMBALANCED = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
def body(x):
    n = jnp.where(jax.lax.axis_index("d") == 0, 1, 4000)
    y = jax.lax.fori_loop(0, n, lambda k, v: jnp.tanh(v @ v.T @ v * 0.01), x[0])
    return jax.lax.psum(y, "d")[None]
mesh = Mesh(jax.devices()[:2], ("d",))
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
print(float(f(jnp.ones((2, 256, 256)))[0, 0, 0]))
"""


def test_xla_takes_the_collective_flags_and_a_late_device_only_warns(tmp_path):
    """One host device reaching the round's sum seconds after the other: XLA:CPU accepts the
    flags fedax sets (an unknown flag aborts it), and with a 1 s warning threshold it warns
    and goes on (the 40 s default terminate timeout is raised to a day the same way)."""
    import os
    import subprocess
    import sys

    from fedax.cli.processes import with_collective_patience

    flags = with_collective_patience("--xla_force_host_platform_device_count=2 "
                                     "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _IMBALANCED], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "for 1 seconds" in out.stderr  # it did wait past the threshold, and finished


def test_kernel_choice_per_model_and_precision():
    from fedax.simulation.host import cpu_dots_for

    assert cpu_dots_for("char_lstm") == "ynn"
    assert cpu_dots_for("cnn") is None and cpu_dots_for("2nn") is None  # fedax's default
    assert cpu_dots_for("cnn", "bfloat16") == "ynn"
