"""Server optimizers of Adaptive Federated Optimization (Reddi et al., ICLR 2021, Algorithm 2).

Each is an optax ``GradientTransformation`` for FedAvg's (or SCAFFOLD's) ``server_optimizer``.
It receives the pseudo-gradient g_t = x_t − mean_i(x_i) = −Δ_t, the server model minus the
mean client model (Reddi et al.'s Δ_t is the mean client *change*, client − server, hence the
sign), and returns the step to *add* to x_t (``optax.apply_updates``). In the paper's terms:

    m_t = β1 m_{t−1} + (1 − β1) Δ_t
    v_t = v_{t−1} + Δ_t²                                   FedAdagrad
    v_t = β2 v_{t−1} + (1 − β2) Δ_t²                       FedAdam
    v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)     FedYogi
    v̂_t = max(v̂_{t−1}, v_t), with v_t as FedAdam's         FedAMSGrad (v̂ replaces v below)
    x_{t+1} = x_t + η m_t / (√v_t + τ)

with m_{−1} = 0 and no bias correction. The paper requires v_{−1} ≥ τ²; we start at
v_{−1} = τ² (the smallest allowed) unless ``initial_accumulator`` is given (the authors' TFF
experiments used Keras optimizers, whose Adagrad accumulator starts at 0). Since m_t is linear
in Δ and v_t depends on Δ² only, the transform computes m on g = −Δ and returns −η m/(√v + τ),
exactly the paper's step. FedAvgM (Hsu et al. 2019) is server SGD with heavy-ball momentum,
m_t = β m_{t−1} + Δ_t, x_{t+1} = x_t + η m_t: ``optax.sgd(lr, momentum)``.

How they differ from optax's own ``adam`` / ``yogi`` / ``adagrad`` / ``amsgrad``:

* **bias correction**: optax divides m and v by 1 − β^t (AMSGrad: the max is taken over the
  corrected v); Reddi et al. do not, so early rounds take smaller steps here.
* **where τ enters**: here τ is added to √v (as optax's ``eps``, not ``eps_root``); optax's
  ``adagrad`` instead adds its eps inside the root, g/√(v + eps), and returns 0 where v = 0.
* **initial v**: here τ² (paper); optax ``adam``/``amsgrad`` start at 0, ``yogi`` at 1e-6 (and
  also starts *m* at 1e-6), ``adagrad`` at 0.1.
* **momentum in Adagrad**: FedAdagrad keeps the paper's m_t with β1 (default 0, i.e. plain
  Adagrad, as in the paper's experiments); optax's ``adagrad`` has no momentum.
* **defaults**: τ = 1e-3 (the authors' recommended default), β1 = 0.9, β2 = 0.99 for
  Adam/Yogi/AMSGrad (the paper's; the TFF run scripts used Keras' 0.999).

Note also that fedax's FedAvg forms the mean client model with n_k weights, whereas the
paper's Δ_t is the unweighted 1/|S| mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class FedAdaptiveState(NamedTuple):
    """State of FedAdagrad / FedAdam / FedYogi: first moment m, second moment v."""

    m: Any
    v: Any


class FedAMSGradState(NamedTuple):
    """State of FedAMSGrad: m, v and the running maximum v̂ of v."""

    m: Any
    v: Any
    v_hat: Any


def _check(tau, b1, b2, initial_accumulator):
    if not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau!r}.")
    for name, b in (("b1", b1), ("b2", b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}.")
    v0 = tau**2 if initial_accumulator is None else initial_accumulator
    if not v0 >= 0:
        raise ValueError(f"initial_accumulator must be >= 0, got {initial_accumulator!r}.")
    return v0


def _fed_adaptive(
    lr: float,
    b1: float,
    tau: float,
    v0: float,
    second_moment: Callable[[jax.Array, jax.Array], jax.Array],
    amsgrad: bool = False,
) -> optax.GradientTransformation:
    """m/v/x updates of Algorithm 2 on the pseudo-gradient g = −Δ; ``second_moment(v, g²)``."""

    def init(params):
        m = jax.tree.map(jnp.zeros_like, params)
        v = jax.tree.map(lambda p: jnp.full_like(p, v0), params)
        return FedAMSGradState(m, v, v) if amsgrad else FedAdaptiveState(m, v)

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda mm, g: b1 * mm + (1.0 - b1) * g, state.m, updates)
        v = jax.tree.map(lambda vv, g: second_moment(vv, jnp.square(g)), state.v, updates)
        if amsgrad:
            v_hat = jax.tree.map(jnp.maximum, state.v_hat, v)
            new_state, denom = FedAMSGradState(m, v, v_hat), v_hat
        else:
            new_state, denom = FedAdaptiveState(m, v), v
        steps = jax.tree.map(lambda mm, vv: -lr * mm / (jnp.sqrt(vv) + tau), m, denom)
        return steps, new_state

    return optax.GradientTransformation(init, update)


def fedadagrad(
    lr: float, tau: float = 1e-3, b1: float = 0.0, initial_accumulator: float | None = None
) -> optax.GradientTransformation:
    """FedAdagrad: v_t = v_{t−1} + Δ_t²; x ← x + η m_t/(√v_t + τ).

    Args:
      lr: server learning rate η.
      tau: adaptivity τ (smaller: more adaptive).
      b1: first-moment decay β1 (0: plain Adagrad, the paper's experiments).
      initial_accumulator: v_{−1}; default τ² (the paper requires v_{−1} ≥ τ²).
    """
    v0 = _check(tau, b1, 0.0, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: v + g2)


def fedadam(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
) -> optax.GradientTransformation:
    """FedAdam: v_t = β2 v_{t−1} + (1 − β2) Δ_t²; no bias correction.

    Args:
      lr: server learning rate η.
      b1: first-moment decay β1.
      b2: second-moment decay β2.
      tau: adaptivity τ.
      initial_accumulator: v_{−1}; default τ².
    """
    v0 = _check(tau, b1, b2, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: b2 * v + (1.0 - b2) * g2)


def fedyogi(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
) -> optax.GradientTransformation:
    """FedYogi: v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²); no bias correction.

    Args:
      lr: server learning rate η.
      b1: first-moment decay β1.
      b2: second-moment decay β2.
      tau: adaptivity τ.
      initial_accumulator: v_{−1}; default τ².
    """
    v0 = _check(tau, b1, b2, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: v - (1.0 - b2) * g2 * jnp.sign(v - g2))


def fedamsgrad(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
) -> optax.GradientTransformation:
    """FedAMSGrad: FedAdam's v_t, then v̂_t = max(v̂_{t−1}, v_t) in the denominator.

    Args:
      lr: server learning rate η.
      b1: first-moment decay β1.
      b2: second-moment decay β2.
      tau: adaptivity τ.
      initial_accumulator: v_{−1} = v̂_{−1}; default τ².
    """
    v0 = _check(tau, b1, b2, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: b2 * v + (1.0 - b2) * g2, amsgrad=True)


def fedavgm(lr: float = 1.0, momentum: float = 0.9) -> optax.GradientTransformation:
    """FedAvgM (Hsu et al. 2019): m_t = β m_{t−1} + Δ_t; x ← x + η m_t.

    Heavy-ball momentum without dampening (Keras/TFF ``SGD(momentum)``), which is exactly
    ``optax.sgd(lr, momentum)`` applied to the pseudo-gradient −Δ_t.

    Args:
      lr: server learning rate η (the paper's FedAvgM experiments tune it; 1 is FedAvg's).
      momentum: β (0.9 in Reddi et al.).
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}.")
    return optax.sgd(lr, momentum=momentum)
