"""Early stopping of local training without a validation set: the evidence-based (EB)
criterion of Mahsereci, Balles, Lassner and Hennig (2017; docs/references.md, Local
training and early stopping).

The gradient of the empirical risk is the gradient of the expected risk plus noise from the
finite sample. A minibatch of B examples gives per-example gradients ∇ℓ_i(w) (of the loss
the client descends), their mean g = (1/B) Σ_i ∇ℓ_i and the unbiased per-coordinate variance

    Σ̂_k = 1/(B − 1) · Σ_i (∇ℓ_{i,k} − g_k)².

If the expected risk's gradient were zero, g_k would be noise of variance Σ_k / B, so
B g_k² / Σ̂_k would be about 1 in every coordinate. The EB criterion (the paper's minibatch
form, its Eq. 7)

    c = 1 − (B / D) · Σ_k g_k² / Σ̂_k

is positive when the gradient is no larger than that noise, and training stops there: what
is left to fit is the sample, not the distribution. What fedax chooses (the paper was read
through its abstract and introduction and the authors' later implementation in Cockpit,
``cockpit/quantities/early_stopping.py``, which computes the left-hand side of Eq. 7 with
B − 1 and a stabilizing ε = 1e-5 added to Σ̂):

* **B** is the number of *real* examples of the batch (the mask's), and Σ̂ divides by B − 1
  (unbiased). A batch with fewer than two real examples has no variance estimate: it is not
  checked (no decision), so a client with a single example runs all its steps.
* **Σ̂_k ≈ 0 is left out**, not smoothed by an ε: D counts the *informative* coordinates,
  Σ̂_k > ρ² g_k² with ρ = 1e-4 (``RELATIVE_SPREAD``), and the sum runs over them. A
  coordinate with no spread over the batch carries no evidence either way: most often every
  example's gradient there is exactly 0 (an input pixel that is blank in the whole batch, a
  dead unit), where an ε would add a 0 to the sum and 1 to D and so push c towards stopping
  by the fraction of such coordinates, a property of the batch, not of training; otherwise
  every example agrees (duplicated data), where an ε would make g_k²/ε huge and the client
  never stop. ε also has the gradient's units squared, so no one value fits every model.
  ρ is relative: identical examples need not give bit-identical gradients (XLA:CPU rounds a
  vectorized batch's rows differently), and a spread below 1e-4 of the mean is float32
  rounding, not data; it costs only coordinates whose g_k²/Σ̂_k would exceed 10⁸. The
  variance is computed shifted by the first real example's gradient (d_i = ∇ℓ_i −
  ∇ℓ_first, Σ̂_k = (Σ d²_ik − (Σ d_ik)²/B)/(B − 1)), which keeps it accurate when the spread
  is small against the mean.
* **No coordinate informative** (B ≥ 2 real examples, all with the same gradient): c = 1,
  stop. Nothing in the batch shows that its gradient generalizes beyond one example, and the
  EB rule stops when the evidence for signal is gone. A client whose data is one example
  repeated stops at its first check.
* **Smoothing** over checks is an option (``smoothing`` β: c̄ ← β c̄ + (1 − β) c, starting
  at the first check's c), off by default; the minibatch criterion is noisy, and β trades
  that noise against a later stop. ``threshold``: stop when the (smoothed) c exceeds it
  (the paper's 0). c ≤ 1 always, so ``threshold=1`` never stops: the criterion is computed
  and reported only.
* **Small batches** (an option, ``calibrated``; off by default, the paper's form): with
  Gaussian per-example gradients and a zero expected gradient, B g_k²/Σ̂_k follows
  F(1, B − 1), whose mean is (B − 1)/(B − 3), not 1, so at pure noise c averages
  −2/(B − 3) (−0.29 at FedAvg's B = 10) and, averaged over thousands of coordinates, stays
  below 0: the raw rule then fires only on a batch's chance fluctuation. ``calibrated``
  scales the sum by (B − 3)/(B − 1), which centres c at 0 under that null (batches of fewer
  than four real examples are then not checked). This is fedax's, not the paper's.
* A non-finite per-example gradient makes c non-finite, which never stops a client (its
  update is then non-finite too, and the server rejects it).

Where it is checked (``fedax.client.local_train(..., stopping=EBStopping(every=m))``):
before step j = m, 2m, ... of the ``[S]`` local steps, on step j's batch at the current
parameters, so a client always takes its first m steps; a client stopped before step j
skips steps j, j+1, ... exactly as padding steps are skipped (parameters and optimizer
state unchanged), and ``num_steps`` counts the steps it took. The step axis is cut into
⌈S/m⌉ groups of m (the last padded with empty steps), and the criterion is computed once
per group, so under ``vmap`` the per-example gradients cost one extra pass every m steps,
and a round still compiles once.

Derivatives: the decision is discrete, so a derivative of a round with EB stopping is the
derivative of the *stopped* computation with the stopping step held fixed: the criterion
reads ``stop_gradient`` of the parameters, and the stopped steps are selected away. Where a
small change of a hyperparameter does not move any client's stopping step (almost
everywhere), this is the derivative of the round itself; across a step change the round
jumps and has none.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# ``fedax.client.local_training``'s ``LossFn`` and ``Batches`` (which import this module):
# ``loss_fn(params, batch) -> scalar``, a masked mean over the batch's examples.
LossFn = Callable[[Any, Any], jax.Array]


class EBStopping(NamedTuple):
    """The EB stopping rule of local training (see the module docstring).

    Attributes:
      every: m ≥ 1: the criterion is checked before steps m, 2m, ...
      threshold: stop when the (smoothed) criterion exceeds it (≤ 1; the paper's 0).
      smoothing: β in [0, 1), the weight of the previous checks in an exponential average
        of the criterion (0: each check alone).
      calibrated: scale the sum by (B − 3)/(B − 1), the small-batch correction that
        centres c at 0 under the null (fedax's; the paper's form is uncalibrated).
    """

    every: int = 1
    threshold: float = 0.0
    smoothing: float = 0.0
    calibrated: bool = False


def eb_stopping(every: int = 1, threshold: float = 0.0, smoothing: float = 0.0,
                calibrated: bool = False) -> EBStopping:
    """A checked ``EBStopping``.

    Raises:
      ValueError: ``every`` not an integer ≥ 1, ``threshold`` not a finite number ≤ 1 (the
        criterion never exceeds 1), or ``smoothing`` outside [0, 1).
    """
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(f"EB stopping needs every >= 1 (an integer), got {every!r}.")
    if not isinstance(threshold, numbers.Real) or not -float("inf") < threshold <= 1:
        raise ValueError(f"EB stopping needs a finite threshold <= 1 (the criterion is at "
                         f"most 1), got {threshold!r}.")
    if not isinstance(smoothing, numbers.Real) or not 0 <= smoothing < 1:
        raise ValueError(f"EB stopping needs smoothing in [0, 1), got {smoothing!r}.")
    if not isinstance(calibrated, bool):
        raise ValueError(f"EB stopping needs calibrated True or False, got {calibrated!r}.")
    return EBStopping(int(every), float(threshold), float(smoothing), calibrated)


class EBCheck(NamedTuple):
    """One evaluation of the criterion on a batch.

    Attributes:
      value: c (float32); 1 when no coordinate is informative.
      defined: the batch has at least two real examples (else ``value`` means nothing).
      informative: D, the coordinates with Σ̂_k > ρ² g_k² (int32).
    """

    value: jax.Array
    defined: jax.Array
    informative: jax.Array


class StopState(NamedTuple):
    """A client's stopping state through its local steps.

    Attributes:
      stopped: bool, the criterion has fired (no further steps).
      checks: int32, the checks made (defined batches, before the client stopped).
      criterion: float32, the last (smoothed) criterion value; 0 before the first check.
    """

    stopped: jax.Array
    checks: jax.Array
    criterion: jax.Array


RELATIVE_SPREAD = 1e-4
"""ρ: coordinate k is informative when Σ̂_k > ρ² g_k² (its examples differ by more than
float32 rounding of their mean); see the module docstring."""


def init_stop_state() -> StopState:
    return StopState(jnp.zeros((), bool), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))


def eb_statistics(grads: Any, mask: jax.Array, calibrated: bool = False) -> EBCheck:
    """The EB criterion of per-example gradients.

    Args:
      grads: a pytree whose leaves are ``[B, ...]``: example i's gradient in row i.
      mask: ``[B]``; the examples with ``mask > 0`` are real, the others are left out.
      calibrated: scale the sum by (B − 3)/(B − 1) (then ``defined`` needs B ≥ 4).

    Returns:
      ``EBCheck``: c = 1 − (B/D) Σ_{k: Σ̂_k > ρ²g_k²} g_k²/Σ̂_k over every coordinate of
      every leaf, B the real examples, D the informative coordinates (c = 1 when D = 0).
    """
    real = mask > 0
    weights = real.astype(jnp.float32)
    count = jnp.sum(weights)
    first = jnp.argmax(real)  # the shift: the first real example's gradient
    total = jnp.zeros((), jnp.float32)
    informative = jnp.zeros((), jnp.int32)
    for leaf in jax.tree.leaves(grads):
        g = leaf.reshape(leaf.shape[0], -1).astype(jnp.float32)
        dev = jnp.where(real[:, None], g - g[first], 0.0)
        # Sums over the batch as products with the 0/1 weights: XLA:CPU reduces the leading
        # axis of a [B, D] array several times slower than it multiplies (full float32
        # precision: an accelerator's default may round the products to TF32 or bfloat16).
        s1 = jnp.dot(weights, dev, precision=jax.lax.Precision.HIGHEST)
        s2 = jnp.dot(weights, jnp.square(dev), precision=jax.lax.Precision.HIGHEST)
        mean = g[first] + s1 / jnp.maximum(count, 1.0)
        var = jnp.maximum(s2 - jnp.square(s1) / jnp.maximum(count, 1.0), 0.0) \
            / jnp.maximum(count - 1.0, 1.0)
        keep = var > jnp.square(RELATIVE_SPREAD * mean)
        total = total + jnp.sum(jnp.where(keep, jnp.square(mean) / jnp.where(keep, var, 1.0),
                                          0.0))
        informative = informative + jnp.sum(keep).astype(jnp.int32)
    dims = jnp.maximum(informative, 1).astype(jnp.float32)
    scale = count / dims
    if calibrated:
        scale = scale * (count - 3.0) / jnp.maximum(count - 1.0, 1.0)
    value = jnp.where(informative > 0, 1.0 - scale * total, 1.0)
    return EBCheck(value, count >= (4 if calibrated else 2), informative)


def per_example_gradients(loss_fn: LossFn, params: Any, batch: Any) -> Any:
    """``∇ℓ_i(params)`` for every example of ``batch`` (float features), leaves ``[B, ...]``:
    ℓ_i is ``loss_fn`` on a batch of one (``x[None]``, ``y[None]``, ``mask[None]``), so
    ``loss_fn`` must be a masked mean of per-example terms (as for DP-SGD)."""

    def example_loss(p, example):
        return loss_fn(p, jax.tree.map(lambda a: a[None], example))

    return jax.vmap(jax.grad(example_loss), in_axes=(None, 0))(params, batch)


def eb_criterion(loss_fn: LossFn, params: Any, batch: Any,
                 calibrated: bool = False) -> EBCheck:
    """The EB criterion of ``loss_fn`` at ``params`` on one batch (float features)."""
    return eb_statistics(per_example_gradients(loss_fn, params, batch), batch.mask,
                         calibrated)


def update_stop_state(rule: EBStopping, state: StopState, check: EBCheck) -> StopState:
    """``state`` after ``check``: a defined check of a running client updates the (smoothed)
    criterion and stops the client when it exceeds ``rule.threshold``."""
    active = jnp.logical_and(check.defined, ~state.stopped)
    value = check.value.astype(jnp.float32)
    smoothed = jnp.where(state.checks > 0,
                         rule.smoothing * state.criterion + (1.0 - rule.smoothing) * value,
                         value)
    fire = jnp.logical_and(active, smoothed > rule.threshold)
    return StopState(jnp.logical_or(state.stopped, fire),
                     state.checks + active.astype(jnp.int32),
                     jnp.where(active, smoothed, state.criterion))
