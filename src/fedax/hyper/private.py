"""Private hypergradients: the derivative of a DP round releases only clipped, noised sums.

A DP round (``fedax.aggregators.dp_gaussian``) releases one privatized sum per round on its
train cohort S_t, Δ̃_t = (Σ_{k∈S_t} clip_S(Δ_k) + N(0, (zS)²)) / D. ``fedax.hyper`` then
evaluates a holdout loss on fresh clients H_t,
L_H(x_{t+1}) = Σ_{k∈H_t} (n_k/n_H) F_k(x_{t+1}), and differentiates it w.r.t. hyperparameters
h. Every value that moves from clients to the server is a ``federated_sum``, so the question
"does the derivative leak more than the round?" is: which sums does differentiation add,
which of them depend on client data, and are those clipped and noised?

Which sums each mode adds
-------------------------

*Reverse mode* transposes every broadcast of a value that depends on h into a sum of
per-client cotangents, ``Σ_k J_kᵀ ḡ`` (J_k: client k's Jacobian, through its own data): a
model-sized, data-dependent client→server release that the forward DP aggregator never sees.
Sums transpose into broadcasts (server→client: no release). Where this happens:

* the holdout broadcast of x_{t+1}, always (x_{t+1} depends on η): the server receives
  ``Σ_{k∈H} (n_k/n_H) ∇F_k(x_{t+1})``, a sum of holdout clients' gradients;
* the train broadcast of the payload x_t, only when x_t depends on h: a hypergradient through
  T > 1 rounds (``hypergradient``), or a hyperparameter sent to the clients. Through ONE
  round with the server learning rate only (``learned_server_lr_in_state``), x_t does not
  depend on η and JAX's partial evaluation leaves the whole train cohort out of the backward
  pass: ∂L/∂u = −η ⟨∇L_H(x_{t+1}), Δ̃_t⟩ uses the released Δ̃_t (post-processing), and the
  train cohort releases nothing more than the round. On the jaxpr of
  ``learned_server_lr_in_state(mode="reverse")`` around a ``dp_gaussian`` FedAvg round the
  derivative program holds exactly one sum per model leaf: the holdout's transposed
  broadcast (``tests/test_private_hypergradient.py`` checks it). So even this case leaks,
  on the holdout clients;
* the broadcast of anything else that depends on h (aggregator state, a client-side
  hyperparameter placed with ``broadcast``). A hyperparameter that client code *closes
  over* (the client learning rate of ``fedavg``) is summed by ``vmap``'s own transpose,
  outside the placement primitives: invisible to the audit (``fedax.federated.audit``), and not
  privatizable without broadcasting it as part of the payload.

*Forward mode* carries a tangent with every value: broadcasts carry tangents down (no
release), and every sum carries a tangent sum up, a second release next to the primal one.
The data-dependent tangent sums are:

* holdout: ``Σ_k w_k ⟨∇F_k(x_{t+1}), ẋ_{t+1}⟩``, one scalar per holdout client and tangent
  direction (for the server lr ẋ_{t+1} = −η Δ̃_t, computed on the server from the release);
* train, only when a tangent reaches the train clients (T > 1 rounds, a carried tangent as
  in ``learned_server_lr_carried``, a client hyperparameter): then the DP aggregator's JVP
  releases ``Σ_k ∂clip(Δ_k)[Δ̇_k]``, where the clip's Jacobian has norm ≤ 1 but Δ̇_k is
  unbounded, and the noise has tangent zero (its key is fixed): an unclipped, unnoised
  release. fedax's DP aggregators do not privatize tangents, so forward mode is private
  only while tangents stay off the train cohort (one round, server-side hyperparameters),
  which is what :func:`private_learned_server_lr` does.

In both modes the primal holdout loss itself, ``Σ n_k F_k / Σ n_k`` (metric
``holdout_loss``), is an unnoised release of holdout data (and Σ n_k of their sizes).

Privatizing, and what it costs
------------------------------

Each fix is one Gaussian release of multiplier z (noise standard deviation over the clip
norm, i.e. over the sensitivity of the sum under adding or removing one client) on the
cohort it sums over; a Gaussian release costs the same ε whatever its dimension.

* reverse: :func:`private_broadcast` is ``fed.broadcast`` whose backward clips each
  client's cotangent to L2 norm ``clip``, sums with ``fed.sum`` and adds N(0, (z·clip)²):
  +1 release per privatized broadcast per round. :func:`with_private_payload` does this
  for a round's payload (train cohort, multi-round hypergradients).
* forward: the tangent sum is clipped per client and noised with its own key: +1 release
  per scalar tangent direction (hyperparameter) per privatized sum per round. With
  ``jax.jacfwd`` over several directions the directions would share the noise (one key
  under ``vmap``), revealing their differences: use one ``jax.jvp`` per direction and key.
* the holdout loss value: +1 if released (``HoldoutPrivacy.release_loss``); otherwise
  nothing is summed for it (its value is not computed, only its derivative).

For the learned server learning rate (:func:`private_learned_server_lr`) both modes cost
the same: per round 1 holdout release for the hypergradient, +1 for the loss value
(:func:`extra_releases_per_round`). Forward mode is the better one for a scalar
hyperparameter: its noise on the hypergradient is z·T/D_H with T bounding
|⟨∇F_k, ẋ⟩|, while reverse mode's is z·G·‖ẋ‖/D_H with G bounding ‖∇F_k‖, and
T = G‖ẋ‖ always suffices (Cauchy-Schwarz). For k hyperparameters reverse mode costs 1
release, forward mode k.

Accounting: ``fedax.privacy.epsilon(..., extra_releases_per_round=k)`` counts k more
Gaussian releases on the round's own Poisson sample. The holdout releases are on H_t, a
separate sample; when H_t is sampled independently at the same rate q this is an upper
bound (at small q a round costs ≈ q²(e^{(1+k)/z²} − 1) in Rényi DP counted on one sample,
and q²(e^{1/z²} − 1) + q²(e^{k/z²} − 1) on two; the test checks the bound numerically).

Keys: every release draws from its own key, split from the round key with
``jax.random.split``. Not ``fold_in(key, i)`` next to ``split(key, n)``: with JAX's
(default) partitionable threefry, ``fold_in(key, i) == split(key, n)[i]``, and reusing
noise between two releases reveals the difference of the sums exactly.

Where the pieces are: the clip and the noise as primitives in ``fedax.federated``
(``dp_clip``, ``dp_noise``);
``private_sum``, ``private_broadcast``, ``privatize_payload`` and ``with_private_payload``
in ``fedax.hyper.private_sums``; the check that a derivative program sends nothing
unprivatized (``audit_sums``, ``unprivatized_sums``) in ``fedax.federated.audit``. This module
holds the private holdout loss and the learned server learning rate built on them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from fedax import federated as fed
from fedax.aggregators.dp import _non_negative, _positive
from fedax.algorithms import CohortBatches, FederatedAlgorithm
from fedax.algorithms.base import client_mean_loss
from fedax.client import LossFn
from fedax.federated._dp import _clip_impl, dp_clip
from fedax.hyper.hypergradient import Mode
from fedax.hyper.hypergradient_descent import HyperCohort, HyperState
from fedax.hyper.private_sums import _check_key, private_broadcast, private_sum
from fedax.hyper.server_lr import require_injected_lr, with_state_lr

# ------------------------------------------------------------------- the holdout loss


@dataclasses.dataclass(frozen=True)
class HoldoutPrivacy:
    """How the holdout clients' releases of a hypergradient are privatized.

    Attributes:
      noise_multiplier: z ≥ 0 of every holdout release (z = 0: not private).
      denominator: D_H > 0, the fixed divisor of the holdout sums: the expected number of
        holdout clients (as ``dp_gaussian``'s D; the realised count would leak). Every
        client with n_k > 0 counts with weight 1.
      grad_clip: reverse mode: L2 bound of one holdout client's gradient of its (clipped)
        loss w.r.t. the model; its cotangent, (1/D_H)·∇, is clipped to grad_clip/D_H.
      tangent_clip: forward mode: bound of |dF_k/dh| per client, per unit tangent.
      loss_clip: bound of |F_k| in the released loss value (a client's loss is scaled to
        it, so a loss above it has derivative zero).
      release_loss: release the loss value (+1 release); if False the round computes no
        holdout loss value, only its derivative, and reports no ``holdout_loss``.
    """

    noise_multiplier: float
    denominator: float
    grad_clip: float | None = None
    tangent_clip: float | None = None
    loss_clip: float | None = None
    release_loss: bool = True

    def __post_init__(self):
        _non_negative("HoldoutPrivacy noise_multiplier", self.noise_multiplier)
        _positive("HoldoutPrivacy denominator", self.denominator)
        for name in ("grad_clip", "tangent_clip", "loss_clip"):
            if getattr(self, name) is not None:
                _positive(f"HoldoutPrivacy {name}", getattr(self, name))
        if self.release_loss and self.loss_clip is None:
            raise ValueError("HoldoutPrivacy release_loss=True needs loss_clip (the bound of "
                             "one client's loss in the released value).")

    def check(self, mode: Mode) -> None:
        """Raise if ``mode`` needs a clip that is not set."""
        if mode not in ("forward", "reverse"):
            raise ValueError(f"mode must be 'forward' or 'reverse', got {mode!r}.")
        needed = "grad_clip" if mode == "reverse" else "tangent_clip"
        if getattr(self, needed) is None:
            raise ValueError(f"HoldoutPrivacy needs {needed} for mode={mode!r}.")


def _gradient_only_total(values: jax.Array) -> jax.Array:
    """A server-placed zero whose derivative is that of ``fed.sum(values)``: the clients
    send nothing for the value, and the backward pass only broadcasts (server → client)."""
    n = values.shape[0]

    @jax.custom_vjp
    def total(values):
        return jnp.zeros(values.shape[1:], values.dtype)

    def backward(_, cotangent):
        return (fed.broadcast(cotangent, n),)

    total.defvjp(lambda values: (total(values), None), backward)
    return total(values)


def _forward_private_total(values: jax.Array, privacy: HoldoutPrivacy, value_key,
                           tangent_key) -> jax.Array:
    """Σ_k clip(F_k) released privately (or not computed), with a private tangent sum."""
    z = privacy.noise_multiplier

    def clipped(v):
        if privacy.loss_clip is None:
            return v
        return _clip_impl(v, clip=privacy.loss_clip, batch_ndim=1, bounds=None,
                          weighted=False)[0]

    @jax.custom_jvp
    def total(v):
        if privacy.release_loss:
            assert privacy.loss_clip is not None  # release_loss needs it (__post_init__)
            return private_sum(v, clip=privacy.loss_clip, noise_multiplier=z, key=value_key)
        return jnp.zeros(v.shape[1:], v.dtype)

    @total.defjvp
    def total_jvp(primals, tangents):
        (v,), (t,) = primals, tangents
        _, t = jax.jvp(clipped, (v,), (t,))
        assert privacy.tangent_clip is not None  # forward mode: privacy.check
        return total(v), private_sum(t, clip=privacy.tangent_clip, noise_multiplier=z,
                                     key=tangent_key)

    return total(values)


def private_federated_loss(loss_fn: LossFn, params: Any, cohort: CohortBatches,
                           privacy: HoldoutPrivacy, key: jax.Array | None, *,
                           mode: Mode = "reverse") -> jax.Array:
    """The holdout loss (1/D_H) Σ_k clip(F_k), its value and its derivative privatized.

    Each client k with n_k > 0 (and a finite loss) contributes its mean loss F_k over its
    real batches, clipped to ``loss_clip``; the value is released with noise
    (``release_loss``) or not computed. Its derivative w.r.t. ``params`` in ``mode``:

    * reverse: the model reaches the clients by :func:`private_broadcast`, so the gradient
      sum each client's ∇F_k/D_H flows into is clipped (to grad_clip/D_H) and noised;
    * forward: the tangent sum of the dF_k (one per jvp direction) is clipped to
      ``tangent_clip`` and noised (a ``custom_jvp``; one ``jax.jvp`` direction per key).

    Releases: 1 for the derivative, +1 for the value if released; each multiplier z.
    """
    privacy.check(mode)
    z, denominator = privacy.noise_multiplier, privacy.denominator
    _check_key("private_federated_loss", z, key)
    value_key, derivative_key = (None, None) if key is None else jax.random.split(key)
    n = cohort.num_examples.shape[0]
    if mode == "reverse":
        assert privacy.grad_clip is not None  # reverse mode: privacy.check
        at_clients = private_broadcast(params, n, clip=privacy.grad_clip / denominator,
                                       noise_multiplier=z, key=derivative_key)
    else:
        at_clients = fed.broadcast(params, n)
    losses = fed.map_clients(functools.partial(client_mean_loss, loss_fn), at_clients,
                             cohort.batches)
    counted = jnp.logical_and(cohort.num_examples > 0, jnp.isfinite(losses))
    losses = jnp.where(counted, losses, jnp.zeros((), losses.dtype))
    if mode == "forward":
        total = _forward_private_total(losses, privacy, value_key, derivative_key)
    elif privacy.release_loss:
        assert privacy.loss_clip is not None  # release_loss needs it (__post_init__)
        total = private_sum(losses, clip=privacy.loss_clip, noise_multiplier=z, key=value_key)
    else:
        if privacy.loss_clip is not None:
            losses = dp_clip(losses, privacy.loss_clip)
        total = _gradient_only_total(losses)
    return total / jnp.asarray(denominator, total.dtype)


# --------------------------------------------------------- the learned server learning rate


def private_learned_server_lr(
    algorithm: FederatedAlgorithm,
    init_lr: float,
    loss_fn: LossFn,
    privacy: HoldoutPrivacy,
    hyper_optimizer: optax.GradientTransformation | None = None,
    mode: Mode = "reverse",
) -> FederatedAlgorithm:
    """``fedax.hyper.learned_server_lr_in_state`` whose hypergradient is private.

    Each round sets η = exp(u) in ``algorithm``'s server optimizer state, runs the round
    (with its own DP aggregator: the train cohort's release), and descends the holdout loss
    :func:`private_federated_loss` in u by its one-round hypergradient, in ``mode``. Through
    one round the derivative sends nothing to the train clients (module docstring), so the
    holdout releases are the only extra ones: :func:`extra_releases_per_round` (1, +1 with
    ``privacy.release_loss``). The round key is split: one key for the round, one for the
    holdout releases.

    The round takes a ``HyperCohort``; metrics add ``server_lr`` (the η used),
    ``hypergradient`` (the noisy one), ``hypergradient_norm`` and, if released,
    ``holdout_loss``. Default hyper-optimizer: ``optax.adam(0.05)`` on log η.
    """
    privacy.check(mode)
    hyper_optimizer = hyper_optimizer or optax.adam(0.05)

    def init(params, key):
        inner = algorithm.init(params, key)
        require_injected_lr(inner)
        log_lr = jnp.log(jnp.float32(init_lr))
        return HyperState(inner, log_lr, hyper_optimizer.init(log_lr))

    def round_fn(state: HyperState, cohort: HyperCohort, key):
        round_key, holdout_key = jax.random.split(key)

        def objective(log_lr):
            inner, metrics = with_state_lr(algorithm, jnp.exp(log_lr)).round(
                state.inner, cohort.train, round_key)
            loss = private_federated_loss(loss_fn, algorithm.server_params(inner),
                                          cohort.holdout, privacy, holdout_key, mode=mode)
            return loss, (inner, metrics)

        if mode == "reverse":
            (loss, (inner, metrics)), grad = jax.value_and_grad(objective, has_aux=True)(
                state.hparams)
        else:
            loss, grad, (inner, metrics) = jax.jvp(
                objective, (state.hparams,), (jnp.ones_like(state.hparams),), has_aux=True)
        updates, hyper_state = hyper_optimizer.update(grad, state.hyper_opt_state,
                                                      state.hparams)
        log_lr = optax.apply_updates(state.hparams, updates)
        metrics = dict(metrics, server_lr=jnp.exp(state.hparams), hypergradient=grad,
                       hypergradient_norm=jnp.abs(grad))
        if privacy.release_loss:
            metrics["holdout_loss"] = loss
        return HyperState(inner, log_lr, hyper_state), metrics

    # FederatedAlgorithm types a round's cohort as CohortBatches; this one's is a HyperCohort
    return FederatedAlgorithm(init, cast(Any, round_fn), lambda state: algorithm.server_params(
        state.inner))


def extra_releases_per_round(mode: Mode, *, hyperparameters: int = 1,
                             release_loss: bool = True, private_payload: bool = False) -> int:
    """Gaussian releases a private hypergradient adds per round, for
    ``fedax.privacy.epsilon(..., extra_releases_per_round=k)`` (each at the round's z).

    * reverse: 1 (the holdout gradient sum, whatever the number of hyperparameters)
      + 1 if the loss value is released + 1 if the payload's transposed broadcast is
      privatized (``with_private_payload``, hypergradients through several rounds);
    * forward: one tangent sum per scalar hyperparameter (jvp direction) + 1 if the loss
      value is released. A tangent that reaches the train clients would need each DP
      sum's tangent privatized too (+``hyperparameters`` per sum), which fedax's DP
      aggregators do not do: ``private_payload`` is an error in forward mode.

    (The holdout releases are on the holdout cohort; counted on the train cohort's sample
    they give an upper bound, see the module docstring.)
    """
    if mode not in ("forward", "reverse"):
        raise ValueError(f"mode must be 'forward' or 'reverse', got {mode!r}.")
    if isinstance(hyperparameters, bool) or not isinstance(hyperparameters, int) \
            or hyperparameters < 1:
        raise ValueError(f"hyperparameters must be a whole number >= 1 (scalar "
                         f"hyperparameters), got {hyperparameters!r}.")
    if mode == "reverse":
        return 1 + int(bool(release_loss)) + int(bool(private_payload))
    if private_payload:
        raise ValueError(
            "forward mode cannot privatize the train cohort: its tangents ride through the "
            "DP aggregator's sum unclipped and unnoised (fedax's DP aggregators do not "
            "privatize tangents); use mode='reverse' with with_private_payload.")
    return hyperparameters + int(bool(release_loss))

__all__ = [
    "HoldoutPrivacy",
    "extra_releases_per_round",
    "private_federated_loss",
    "private_learned_server_lr",
]
