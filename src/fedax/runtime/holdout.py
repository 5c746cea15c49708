"""Federated AD over the network: the learned server learning rate's hypergradient, computed
by a second kind of client task (Rush et al., FAD, Alg. 2; ``fedax.hyper.learned_server_lr_
in_state`` in the simulator).

Round t runs with η_t = exp(u_t). The server computes the new model x_{t+1}(u) and, by
forward-mode differentiation of its own half of the round, its tangent v = ∂x_{t+1}/∂u
(the clients' reports do not depend on η, which only the server update uses). It then
selects ``holdout_clients`` clients (the simulator's ``default_rng([seed, t, 1])`` with the
simulator's randomness, its own secret otherwise) and sends each (x_{t+1}, v): a broadcast,
as the derivative rule of ``federated_loss``'s broadcast prescribes. Each holdout client
returns its mean loss F_k(x_{t+1}) over all its examples and the directional derivative
⟨∇F_k(x_{t+1}), v⟩ (one JVP), with n_k; the server's n_k-weighted means are the holdout loss
and the hypergradient g_t = ∂L/∂u, and the hyper-optimizer (Adam on u) gives u_{t+1}. So the
derivative of the round is computed with the round's own primitives, a broadcast down and a
weighted sum up, by a real runtime; with the same keys the η trajectory is the simulator's
(tests/test_engines.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax.algorithms import server_learning_rate, with_server_learning_rate
from fedax.algorithms.base import client_mean_loss
from fedax.client import Batches

# A holdout phase's attempts are numbered from here, so that its reports' (round, attempt)
# never match a training attempt's (the server checks both before reading a report).
HOLDOUT_ATTEMPTS = 1 << 20


class HoldoutReport(NamedTuple):
    """What a holdout client sends: F_k(x), ⟨∇F_k(x), v⟩ and n_k."""

    loss: jax.Array
    tangent: jax.Array
    num_examples: jax.Array


def holdout_step(loss_fn, params: Any, tangent: Any, batches: Batches,
                 num_examples: jax.Array) -> HoldoutReport:
    """One holdout client: its mean loss at ``params`` over its real batches and the loss's
    derivative along ``tangent`` (one forward-mode JVP)."""
    loss, derivative = jax.jvp(lambda p: client_mean_loss(loss_fn, p, batches), (params,),
                               (tangent,))
    return HoldoutReport(jnp.asarray(loss, jnp.float32), jnp.asarray(derivative, jnp.float32),
                         jnp.asarray(num_examples, jnp.float32))


def holdout_template(params: Any) -> Any:
    """What the server sends a holdout client: the new model and its tangent."""
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                        params)
    return {"payload": {"params": spec, "tangent": spec}}


def holdout_report_template() -> HoldoutReport:
    """A ``HoldoutReport``'s template: three float32 scalars' ``jax.ShapeDtypeStruct``."""
    return HoldoutReport._make([jax.ShapeDtypeStruct((), jnp.float32)] * 3)


class EvalReport(NamedTuple):
    """What a client evaluating on its own test data sends: its correct predictions, the
    summed cross-entropy and the number of scored targets (tokens, PAD aside)."""

    correct: jax.Array
    loss: jax.Array
    # shadows tuple.count, which mypy refuses; the name is the report's wire path
    count: jax.Array  # type: ignore[assignment]


def eval_step(apply_fn, params: Any, x: jax.Array, y: jax.Array,
              pad_id: int = 0) -> EvalReport:
    """A client's test sums at ``params`` over its own examples (``y [n]`` classes or
    ``[n, T]`` tokens, where targets equal to ``pad_id`` count for nothing)."""
    logits = apply_fn(params, x)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
    weight = (y != pad_id).astype(jnp.float32) if y.ndim > 1 else jnp.ones_like(nll)
    return EvalReport(jnp.sum(correct * weight), jnp.sum(nll * weight), jnp.sum(weight))


def eval_report_template() -> EvalReport:
    """An ``EvalReport``'s template: three float32 scalars' ``jax.ShapeDtypeStruct``."""
    return EvalReport._make([jax.ShapeDtypeStruct((), jnp.float32)] * 3)


@dataclasses.dataclass
class LearnedLR:
    """The server's hypergradient descent on u = log η: ``optimizer`` (optax, on u) and
    ``holdout_clients`` a round; ``u`` and ``opt_state`` are kept in the checkpoint."""

    optimizer: Any
    holdout_clients: int
    u: jax.Array
    opt_state: Any

    @classmethod
    def create(cls, init_lr: float, hyper_lr: float, holdout_clients: int) -> LearnedLR:
        optimizer = optax.adam(hyper_lr)
        u = jnp.log(jnp.float32(init_lr))
        return cls(optimizer, int(holdout_clients), u, optimizer.init(u))

    def state(self) -> dict[str, Any]:
        return {"u": self.u, "opt_state": self.opt_state}

    def restore(self, state: dict[str, Any]) -> None:
        self.u, self.opt_state = jnp.asarray(state["u"]), state["opt_state"]

    def step(self, reports: list[HoldoutReport]) -> dict[str, float]:
        """u ← the optimizer's step on the holdout reports' n_k-weighted hypergradient;
        returns the round's ``holdout_loss``, ``hypergradient_norm`` and ``server_lr`` (the
        η the round used)."""
        n = np.array([float(r.num_examples) for r in reports], np.float64)
        if n.sum() <= 0:
            raise ValueError("the holdout clients hold no examples")
        loss = float(np.dot(n, [float(r.loss) for r in reports]) / n.sum())
        grad = jnp.float32(np.dot(n, [float(r.tangent) for r in reports]) / n.sum())
        used = float(jnp.exp(self.u))
        updates, self.opt_state = self.optimizer.update(grad, self.opt_state, self.u)
        self.u = optax.apply_updates(self.u, updates)
        return {"holdout_loss": loss, "hypergradient_norm": abs(float(grad)),
                "server_lr": used}


def with_lr(state: Any, u: jax.Array) -> Any:
    """``state`` (a ``RoundState``) whose server optimizer's learning rate is exp(u)."""
    server = state.server
    return state._replace(server=server._replace(
        opt_state=with_server_learning_rate(server.opt_state, jnp.exp(u))))


def differentiated_step(step, pieces, state: Any, u: jax.Array, *args) -> tuple[Any, Any, Any]:
    """``step(pieces, state with η = exp(u), *args)`` (the server's half of the round) with
    the tangent of the new model in u: ``(new_state, metrics, ∂x_{t+1}/∂u)``."""

    def new_params(u):
        new_state, metrics = step(pieces, with_lr(state, u), *args)
        return pieces.server_params(new_state.server), (new_state, metrics)

    _, tangent, (new_state, metrics) = jax.jvp(new_params, (u,), (jnp.ones_like(u),),
                                               has_aux=True)
    return new_state, metrics, tangent


def require_lr(state: Any) -> None:
    held = getattr(getattr(state, "server", None), "opt_state", None)
    if held is None or server_learning_rate(held) is None:
        raise ValueError("a learned server learning rate needs a server optimizer that holds "
                         "its learning rate (the registry's algorithms do)")
