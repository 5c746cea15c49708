"""Hypergradients through FedAvg rounds against central finite differences (float64),
forward mode against reverse mode, the federated closure of the derivative program, and the
communication cost of each mode, counted by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedavg
from fedax.client import Batches
from fedax.hyper import (
    HyperCohort,
    federated_loss,
    hypergradient,
    learned_server_lr,
    loss_after_rounds,
)

D, K, C, S, B = 4, 3, 6, 4, 5  # features, classes, clients, local steps, batch


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def make_cohort(rng, clients=C, steps=S, dtype=np.float64):
    x = rng.normal(size=(clients, steps, B, D)).astype(dtype)
    y = rng.integers(0, K, size=(clients, steps, B)).astype(np.int32)
    mask = np.ones((clients, steps, B), dtype)
    mask[0, -1] = 0.0  # client 0 takes one step fewer
    mask[1, -1, 2:] = 0.0  # client 1 ends on a partial batch
    n = mask.sum(axis=(1, 2)) / 2  # any positive weights
    return CohortBatches(Batches(x, y, mask), n.astype(dtype), np.arange(clients, dtype=np.int32))


def make_algorithm(h):
    return fedavg(loss_fn, optax.sgd(h["client_lr"]), optax.sgd(h["server_lr"]))


@pytest.fixture
def setup():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        params = {"w": jnp.asarray(rng.normal(size=(D, K)) * 0.3), "b": jnp.zeros(K)}
        rounds = [make_cohort(rng) for _ in range(2)]
        cohorts = jax.tree.map(lambda *a: np.stack(a), *rounds)
        holdout = make_cohort(rng)
        hparams = {"client_lr": jnp.float64(0.4), "server_lr": jnp.float64(0.9)}
        yield params, cohorts, holdout, hparams


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("remat", [True, False])
def test_hypergradient_equals_central_finite_differences(setup, mode, remat):
    params, cohorts, holdout, hparams = setup
    value, grads = jax.jit(lambda h: hypergradient(
        make_algorithm, h, params, cohorts, holdout, loss_fn, mode=mode, remat=remat))(hparams)

    @jax.jit  # compiled once for the four evaluations
    def loss_at(h):
        return hypergradient(make_algorithm, h, params, cohorts, holdout, loss_fn)[0]

    eps = 1e-6
    for name in hparams:
        up = dict(hparams, **{name: hparams[name] + eps})
        down = dict(hparams, **{name: hparams[name] - eps})
        fd = (loss_at(up) - loss_at(down)) / (2 * eps)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-6, atol=1e-9)
        assert abs(float(fd)) > 1e-4  # the check is not vacuous
    assert value.dtype == jnp.float64


def test_forward_mode_equals_reverse_mode(setup):
    params, cohorts, holdout, hparams = setup
    v1, g1 = hypergradient(make_algorithm, hparams, params, cohorts, holdout, loss_fn,
                           mode="forward")
    v2, g2 = hypergradient(make_algorithm, hparams, params, cohorts, holdout, loss_fn,
                           mode="reverse")
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    for name in hparams:
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-9)


def _count(jaxpr, counts):
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
        for value in eqn.params.values():
            subs = value if isinstance(value, (tuple, list)) else [value]
            for sub in subs:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _count(sub.jaxpr, counts)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _count(sub, counts)
    return counts


def _cross_client_ops(jaxpr, n, found):
    """Ops other than the federated primitives that reduce or create the clients axis."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "reduce_sum" and eqn.invars[0].aval.ndim and 0 in eqn.params["axes"]:
            if eqn.invars[0].aval.shape[0] == n and eqn.outvars[0].aval.ndim < \
                    eqn.invars[0].aval.ndim:
                found.append(eqn)
        for value in eqn.params.values():
            subs = value if isinstance(value, (tuple, list)) else [value]
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    _cross_client_ops(inner, n, found)
    return found


def test_derivative_program_is_federated(setup):
    """Two rounds of FedAvg and the holdout loss, differentiated in the server learning
    rate: the reverse pass mirrors broadcasts with federated sums and sums with broadcasts,
    and nothing else reduces over the clients axis.

    (A hyperparameter that client code closes over, such as the client learning rate, is
    differentiated correctly, but its per-client cotangents are added by ``vmap``'s own
    transpose, outside the placement primitives; see ``fedax.hyper``.)"""
    params, cohorts, holdout, hparams = setup
    with jax.enable_x64(True):
        client_lr = hparams["client_lr"]

        def f(server_lr):
            h = {"client_lr": client_lr, "server_lr": server_lr}
            return loss_after_rounds(make_algorithm, h, params, cohorts, holdout, loss_fn)

        hparams = hparams["server_lr"]
        primal = _count(jax.make_jaxpr(f)(hparams).jaxpr, {})
        grad_jaxpr = jax.make_jaxpr(jax.grad(f))(hparams).jaxpr
        rev = _count(grad_jaxpr, {})
    # the backward pass adds mirrored exchanges of both kinds
    assert rev["federated_broadcast"] > primal["federated_broadcast"]
    assert rev["federated_sum"] > primal["federated_sum"]
    # and nothing but the federated primitives reduces over the clients axis (C = 6 is
    # no other dimension of the problem), in the round or in its derivative
    assert _cross_client_ops(jax.make_jaxpr(f)(hparams).jaxpr, C, []) == []
    assert _cross_client_ops(grad_jaxpr, C, []) == []


def test_comm_cost_of_each_mode_matches_hand_count():
    """A round of FedAvg on a model of P floats with C clients, then the holdout loss:
    forward: down = C·P·4 (model) + C·P·4 (model after the round, to the holdout clients);
    up = C·P·4 (client deltas) + C·4·3 (weights for the delta mean; loss and its weights
    for the train-loss metric and the local-steps metric) + C·4 (one non-finite indicator
    per client, summed into ``rejected_clients``) + holdout: C·4 (losses) + C·4 (weights).
    We count exactly what the program does, then check the modes' ratios."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((D, K), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
    p_bytes = (D * K + K) * 4
    train = make_cohort(rng, dtype=np.float32)
    holdout = make_cohort(rng, dtype=np.float32)
    alg = fedavg(loss_fn, optax.sgd(0.1))
    state = alg.init(params, None)

    round_cost = fed.comm_cost(alg.round, state, train, None)
    # broadcast the model; clients send deltas, 3 weighted means each sum the weights, and
    # each client's non-finite bit is summed
    assert round_cost.server_to_clients_bytes == C * p_bytes
    assert round_cost.clients_to_server_bytes == C * p_bytes + 3 * C * 4 + 2 * C * 4 + C * 4

    def holdout_loss(lr):
        a = fedavg(loss_fn, optax.sgd(0.1), optax.sgd(lr))
        s, _ = a.round(state, train, None)
        return federated_loss(loss_fn, a.server_params(s), holdout)

    plain = fed.comm_cost(holdout_loss, 1.0)
    assert plain.server_to_clients_bytes == 2 * C * p_bytes
    assert plain.clients_to_server_bytes == round_cost.clients_to_server_bytes + 2 * C * 4

    forward = fed.comm_cost(lambda lr: jax.jvp(holdout_loss, (lr,), (1.0,)), 1.0)
    reverse = fed.comm_cost(jax.grad(holdout_loss), 1.0)
    # forward mode: the tangent of the model rides down with it (server lr affects only the
    # model after the round, so one extra model down to the holdout clients), and the
    # holdout clients return one extra scalar each (plus its weight sum)
    assert forward.server_to_clients_bytes == plain.server_to_clients_bytes + C * p_bytes
    assert forward.clients_to_server_bytes > plain.clients_to_server_bytes
    # reverse mode: a mirrored exchange; every federated sum of the holdout loss becomes a
    # broadcast of its cotangent, and the model's cotangent comes back up from the holdout
    assert reverse.clients_to_server_bytes >= plain.clients_to_server_bytes + C * p_bytes
    assert reverse.server_to_clients_bytes > plain.server_to_clients_bytes


def test_learned_server_lr_recovers_from_a_poor_start():
    """Starting 10x too small, hypergradient descent raises the server learning rate."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.zeros((D, K), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
    w_true = rng.normal(size=(D, K))

    def cohort(clients):
        x = rng.normal(size=(clients, S, B, D)).astype(np.float32)
        y = np.argmax(x @ w_true, axis=-1).astype(np.int32)
        mask = np.ones((clients, S, B), np.float32)
        return CohortBatches(Batches(x, y, mask), np.full(clients, 20.0, np.float32),
                             np.arange(clients, dtype=np.int32))

    for mode in ("forward", "reverse"):
        alg = learned_server_lr(
            lambda lr: fedavg(loss_fn, optax.sgd(0.1), optax.sgd(lr)), 0.1, loss_fn,
            optax.adam(0.1), mode=mode,
        )
        state = alg.init(params, None)
        step = jax.jit(alg.round)
        lrs = []
        for _ in range(15):
            state, metrics = step(state, HyperCohort(cohort(C), cohort(C)), None)
            lrs.append(float(metrics["server_lr"]))
        assert lrs[-1] > 3 * lrs[0], (mode, lrs)


def test_client_weighting_at_zero_is_fedavg_and_its_hypergradient_is_exact(setup):
    from fedax.hyper import weighting

    params, cohorts, holdout, _ = setup
    one = jax.tree.map(lambda a: a[0], cohorts)
    with jax.enable_x64(True):
        plain = fedavg(loss_fn, optax.sgd(0.4))
        s0, _ = plain.round(plain.init(params, None), one, None)

        def after(theta):
            alg = fedavg(loss_fn, optax.sgd(0.4), client_weights=weighting(theta))
            s, _ = alg.round(alg.init(params, None), one, None)
            return s, federated_loss(loss_fn, s.server.params, holdout)

        s1, _ = after(jnp.zeros(2))
        for a, b in zip(jax.tree.leaves(s0.server.params),
                jax.tree.leaves(s1.server.params), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12)
        theta = jnp.array([0.3, -0.2])
        g = jax.grad(lambda t: after(t)[1])(theta)
        eps = 1e-6
        for i in range(2):
            e = jnp.zeros(2).at[i].set(eps)
            fd = (after(theta + e)[1] - after(theta - e)[1]) / (2 * eps)
            np.testing.assert_allclose(g[i], fd, rtol=1e-6, atol=1e-10)


def test_learned_client_weights_down_weight_mislabelled_clients():
    """Half the clients have random labels; hypergradient descent on the holdout loss of
    clean clients learns a negative weight on the local-loss feature."""
    from fedax.hyper import learned_client_weights, weighting

    rng = np.random.default_rng(3)
    params = {"w": jnp.zeros((D, K), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
    w_true = rng.normal(size=(D, K)) * 2

    def cohort(clients, noisy):
        x = rng.normal(size=(clients, S, B, D)).astype(np.float32)
        y = np.argmax(x @ w_true, axis=-1).astype(np.int32)
        y[:noisy] = rng.integers(0, K, size=y[:noisy].shape)
        mask = np.ones((clients, S, B), np.float32)
        return CohortBatches(Batches(x, y, mask), np.full(clients, 20.0, np.float32),
                             np.arange(clients, dtype=np.int32))

    alg = learned_client_weights(
        lambda w: fedavg(loss_fn, optax.sgd(0.3), client_weights=w), loss_fn, optax.adam(0.1)
    )
    state = alg.init(params, None)
    step = jax.jit(alg.round)
    for _ in range(25):
        state, _ = step(state, HyperCohort(cohort(C, C // 2), cohort(C, 0)), None)
    theta = state.hparams
    assert theta[1] < -0.5, theta  # higher local loss -> lower weight
    train = cohort(C, C // 2)
    losses = jnp.array([1.0] * (C // 2) + [0.3] * (C - C // 2))  # noisy clients lose more
    weights = weighting(theta)(train.num_examples, losses)
    assert float(jnp.max(weights[: C // 2])) < float(jnp.min(weights[C // 2 :]))


_HPARAMS = {"client_lr": 0.1, "server_lr": 1.0}


def _cnn_hypergradient(conv_impl, mode):
    """The hypergradient of one FedAvg round of the paper's CNN (2 clients, 1 step of 2)."""
    from fedax.models import get_model, softmax_cross_entropy

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(2, 1, 2, 28, 28, 1)).astype(np.float32)  # clients, steps, batch
    y = rng.integers(0, 10, size=(2, 1, 2)).astype(np.int32)
    cohort = CohortBatches(Batches(x, y, np.ones((2, 1, 2), np.float32)),
                           np.ones(2, np.float32), np.arange(2, dtype=np.int32))
    cohorts = jax.tree.map(lambda a: a[None], cohort)
    hparams = {k: jnp.float32(v) for k, v in _HPARAMS.items()}
    model = get_model("cnn", conv_impl=conv_impl)

    def loss(p, b):
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    def make(h):
        return fedavg(loss, optax.sgd(h["client_lr"]), optax.sgd(h["server_lr"]))

    params = jax.jit(model.init)(jax.random.key(0))
    # Compiled as one program, as users run it (op by op it takes several times longer).
    return jax.jit(lambda h, p: hypergradient(make, h, p, cohorts, cohort, loss, mode=mode))(
        hparams, params)


def test_forward_mode_through_a_reverse_only_cnn_names_the_fix():
    """The CPU CNN default (conv_impl='lax_vjp') has a reverse-mode-only rule: forward-mode
    hypergradients say what to do."""
    with pytest.raises(TypeError, match="conv_impl='lax'"):
        _cnn_hypergradient("lax_vjp", "forward")


@pytest.mark.slow  # two CNN hypergradient programs: half a minute to compile on 2 cores
def test_forward_mode_through_the_lax_cnn_equals_reverse_mode():
    """With conv_impl='lax' forward mode equals reverse mode. (That lax_vjp's gradients
    equal lax's is tested in test_models; comparing against reverse mode through 'lax' here
    compiles in less than half the time of 'lax_vjp'.)"""
    _, forward = _cnn_hypergradient("lax", "forward")
    _, reverse = _cnn_hypergradient("lax", "reverse")
    for name in _HPARAMS:
        np.testing.assert_allclose(forward[name], reverse[name], rtol=2e-3, atol=1e-6)
