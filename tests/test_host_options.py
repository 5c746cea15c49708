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
