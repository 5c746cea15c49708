"""Every ε is true: each combination the registries offer under ``privacy:`` is refused at
config time, or every upload of its rounds is privatized and its ε is the accountant's for
exactly the releases it makes (recounted here with dp-accounting directly).

The grid: every algorithm in ``ALGORITHMS`` × every privacy mechanism (user level:
``gaussian``, ``adaptive``, ``adaclip``; example level) × server lr (fixed, learned) ×
compression (none and every scheme of the config schema).
"""

from __future__ import annotations

import itertools
import math
import typing

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp

from fedax.aggregators import distributed_dp_params
from fedax.algorithms import ALGORITHMS
from fedax.builder.build import build_algorithm
from fedax.builder.privacy_plan import privacy_plan
from fedax.client import Batches
from fedax.privacy import distributed_epsilon
from fedax.spec.config import CompressionConfig, ConfigError, PrivacyConfig, validate_config

N, FRACTION, ROUNDS, DELTA, Z, CLIP = 12, 0.5, 7, 1e-5, 1.3, 1.0
M = 6  # floor(0.5 * 12)
SIZES = [20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75]
MECHANISMS = [*(("user", m) for m in typing.get_args(
    PrivacyConfig.model_fields["mechanism"].annotation.__args__[0])), ("example", None)]
DISTRIBUTED = ("skellam", "discrete_gaussian")
DIM = 1000  # a model's parameters, for distributed DP's accountant
SCHEMES = typing.get_args(CompressionConfig.model_fields["scheme"].annotation)
SCHEME_OPTIONS = {"qsgd": {"levels": 4}, "rotation": {"bits": 4}, "top_k": {"fraction": 0.25}}


def _config(algorithm, level, mechanism, lr, scheme):
    privacy = {"level": level, "noise_multiplier": Z, "clip": CLIP, "delta": DELTA}
    if mechanism is not None:
        privacy["mechanism"] = mechanism
    data = {"rounds": ROUNDS, "dataset": "synthetic", "num_clients": N, "model": "logistic",
            "algorithm": algorithm, "client_fraction": FRACTION, "local_epochs": 1,
            "batch_size": 10, "client_lr": 0.05, "privacy": privacy}
    if algorithm == "fedsgd":
        data.pop("local_epochs"), data.pop("batch_size")
    if lr == "learned":
        data["server"] = {"lr": "learned"}
        data["learned_lr"] = {"clip": 0.5}
    if scheme is not None:
        data["compression"] = {"scheme": scheme, **SCHEME_OPTIONS.get(scheme, {})}
    if mechanism in DISTRIBUTED:  # distributed DP is noise on a secure sum
        data["secure"] = {"bits": 20}
    return data


# ----------------------------------------------------------- what the algorithms upload

D_IN, K = 5, 3


def _apply(params, x):
    return x @ params["w"] + params["b"]


def _params():
    return {"w": jnp.zeros((D_IN, K)), "b": jnp.zeros((K,))}


def _plain_sums(name: str) -> bool:
    """Whether algorithm ``name``'s client message carries exact sums, read from the
    algorithm's own ``client_update`` (not from the registry's declaration)."""
    config = validate_config({**_config(name, "user", "gaussian", "fixed", None),
                              "privacy": None})
    algorithm = build_algorithm(config, _apply, num_clients=N)
    pieces = algorithm.pieces
    params = _params()
    server = pieces.server_init(params)
    batches = Batches(jnp.zeros((2, 4, D_IN)), jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 4)))
    state = None if pieces.client_state is None else pieces.client_state(params)
    message = jax.eval_shape(lambda: pieces.client_update(
        pieces.payload(server), state, batches, jnp.float32(8)))
    return bool(jax.tree.leaves(message.sums))


def _example_dp_builds(name: str) -> bool:
    config = validate_config({**_config(name, "user", "gaussian", "fixed", None),
                              "privacy": None})
    try:
        build_algorithm(config, _apply, num_clients=N, example_privacy=(1.0, 1.0))
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def uploads():
    return {name: (_plain_sums(name), _example_dp_builds(name)) for name in ALGORITHMS}


def test_registry_declarations_match_what_the_algorithms_upload(uploads):
    for name, spec in ALGORITHMS.items():
        plain, example = uploads[name]
        assert bool(spec.exact_sums) == plain, name
        assert spec.example_dp == example, name
    assert ALGORITHMS["scaffold"].exact_sums and ALGORITHMS["fednova"].exact_sums


# ------------------------------------------------------------------------ the recount


def _recount_user(releases: int) -> float:
    """ε of ROUNDS rounds, each ``releases`` Gaussians of multiplier Z on a cohort of M of N
    drawn without replacement, replace-one neighbours (sensitivity 2C: z/2)."""
    inner = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(Z / 2)] * releases)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(N, M, inner), ROUNDS)
    accountant = rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    return accountant.compose(event).get_epsilon(DELTA)


def _recount_example() -> float:
    """Example-level DP-SGD: E·⌈n/B⌉ Poisson-subsampled Gaussians a round at rate B/n for a
    client of n examples, every round counted; the worst client."""
    worst = 0.0
    for n in set(SIZES):
        steps = math.ceil(n / 10)
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(10 / n, dp_accounting.GaussianDpEvent(Z)),
            steps * ROUNDS)
        worst = max(worst, rdp.RdpAccountant().compose(event).get_epsilon(DELTA))
    return worst


def _expected_refusal(algorithm, level, mechanism, lr, scheme, uploads) -> str | None:
    plain, example = uploads[algorithm]
    if level == "user" and scheme is not None and mechanism != "gaussian":
        return "compression"
    if level == "user" and plain:
        return "privacy"
    if level == "example" and not example:
        return "privacy.level"
    if level == "example" and lr == "learned":
        return "server.lr"
    if mechanism in DISTRIBUTED and lr == "learned":
        return "server.lr"  # the holdout reports are not securely aggregated
    return None


def test_every_combination_is_refused_or_fully_accounted(uploads):
    recount = {1: _recount_user(1), 2: _recount_user(2), "example": _recount_example()}
    seen = {"refused": 0, "accepted": 0}
    for algorithm, (level, mechanism), lr, scheme in itertools.product(
            ALGORITHMS, MECHANISMS, ("fixed", "learned"), (None, *SCHEMES)):
        combo = (algorithm, level, mechanism, lr, scheme)
        expected = _expected_refusal(*combo, uploads)
        try:
            config = validate_config(_config(*combo))
        except ConfigError as err:
            message = str(err)
            assert expected is not None, (combo, message)
            assert message.startswith(f"config key '{expected}'"), (combo, message)
            assert "\n" not in message
            seen["refused"] += 1
            continue
        assert expected is None, (combo, "runs, but it should be refused")
        plan = privacy_plan(config, N, SIZES, dim=DIM)
        eps = plan.ledger.epsilon_after(ROUNDS)
        if mechanism in DISTRIBUTED:  # its own accountant: the summed noise, no sampling
            params = distributed_dp_params(CLIP, Z, M, DIM, bits=20, mechanism=mechanism)
            assert eps == pytest.approx(distributed_epsilon(params, ROUNDS, DELTA)), combo
            assert len(plan.releases) == 1 and mechanism in plan.releases[0], combo
            assert plan.summary(config, ROUNDS)["epsilon"] == pytest.approx(eps)
            seen["accepted"] += 1
            continue
        if level == "example":
            assert eps == pytest.approx(recount["example"], rel=1e-9), combo
            continue
        releases = 1 + (lr == "learned")
        assert len(plan.releases) == releases, combo
        assert eps == pytest.approx(recount[releases], rel=1e-9), combo
        summary = plan.summary(config, ROUNDS)
        assert summary["epsilon"] == pytest.approx(recount[releases], rel=1e-9)
        assert summary["releases_per_round"] == releases
        # one neighbouring relation everywhere: the accountant's
        assert "REPLACE_ONE" in summary["accounting"]
        assert summary["neighbouring_relation"].startswith("replace-one")
        assert summary["epsilon_covers"][-1].startswith("neighbours: replace-one")
        assert not any("add-or-remove" in line for line in summary["epsilon_covers"])
        seen["accepted"] += 1
    assert seen["refused"] > 50 and seen["accepted"] > 50, seen


def test_learned_lr_under_privacy_counts_its_hypergradient_and_target_epsilon_includes_it():
    config = validate_config({**_config("fedavg", "user", "gaussian", "learned", None)})
    plan = privacy_plan(config, N, SIZES)
    assert plan.holdout is not None and plan.holdout.noise_multiplier == Z
    assert plan.holdout.tangent_clip == 0.5 and not plan.holdout.release_loss
    # A budget calibrates z for both releases: more noise than for the update alone.
    data = _config("fedavg", "user", "gaussian", "learned", None)
    data["privacy"] = {**data["privacy"], "noise_multiplier": None, "target_epsilon": 8.0}
    z_learned = privacy_plan(validate_config(data), N, SIZES).noise_multiplier
    data.pop("server"), data.pop("learned_lr")
    z_fixed = privacy_plan(validate_config(data), N, SIZES).noise_multiplier
    assert z_learned > z_fixed * 1.2


def test_holdout_release_counted_on_one_sample_bounds_two_independent_samples():
    """The learned η's holdout release is on its own cohort, counted on the train cohort's
    sample: check that this is an upper bound of the two samples accounted separately."""
    one = _recount_user(2)
    single = dp_accounting.SampledWithoutReplacementDpEvent(
        N, M, dp_accounting.GaussianDpEvent(Z / 2))
    two = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    two.compose(dp_accounting.SelfComposedDpEvent(single, 2 * ROUNDS))
    assert one >= two.get_epsilon(DELTA)


# ------------------------------------------------- the uploads, measured on real rounds


def _cohort(rng, poisoned: bool):
    x = rng.normal(size=(M, 3, 10, D_IN)).astype(np.float32)
    y = rng.integers(0, K, size=(M, 3, 10)).astype(np.int32)
    if poisoned:  # the neighbour: client 0's data replaced by extreme data
        x[0] *= 1e4
    from fedax.algorithms import CohortBatches

    return CohortBatches(Batches(jnp.asarray(x), jnp.asarray(y), jnp.ones((M, 3, 10))),
                         jnp.full((M,), 30.0), jnp.arange(M, dtype=jnp.int32))


def _released_change(algorithm_name: str, aggregator) -> float:
    """The largest change of any server-side value a round releases (the model and every
    other server state the clients are sent next), between neighbouring cohorts, with the
    same key: the noise cancels, what is left is the influence of one client."""
    config = validate_config({**_config(algorithm_name, "user", "gaussian", "fixed", None),
                              "privacy": None})
    algorithm = build_algorithm(config, _apply, num_clients=N, aggregator=aggregator)
    state = algorithm.init(_params(), jax.random.key(0))
    key = jax.random.key(1)
    out = []
    for poisoned in (False, True):
        new, _ = jax.jit(algorithm.round)(state, _cohort(np.random.default_rng(0), poisoned),
                                          key)
        out.append(new.server)
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), *out)
    return max(jax.tree.leaves(diffs))


def test_a_dp_round_moves_what_it_releases_by_at_most_the_clip():
    from fedax.aggregators import dp_gaussian

    change = _released_change("fedavg", dp_gaussian(CLIP, Z, M))
    assert change <= 2 * CLIP / M + 1e-5  # replace-one: 2S over the fixed denominator
    assert change > 1e-3  # and the neighbour does move it


def test_scaffold_with_a_dp_aggregator_is_refused_from_python_and_from_the_config():
    """SCAFFOLD's Δc_i bypass the DP aggregator (exact sums): the registry refuses the
    composition in one line before anything is traced, the module's own function when its
    round is traced (whatever a registry entry declared), and the config at validation."""
    from fedax.aggregators import dp_gaussian
    from fedax.algorithms import scaffold

    aggregator = dp_gaussian(CLIP, Z, M)
    with pytest.raises(ValueError, match=r"^algorithm 'scaffold' uploads .* exact sums .* "
                       r"DP release does not cover; use one of fedavg"):
        ALGORITHMS["scaffold"](_loss, num_clients=N, client_lr=0.05, aggregator=aggregator)
    direct = scaffold(_loss, 0.05, N, aggregator=aggregator)
    state = direct.init(_params(), jax.random.key(0))
    with pytest.raises(ValueError, match="exact sums beside the update.*DP release"):
        jax.eval_shape(direct.round, state, _cohort(np.random.default_rng(0), False),
                       jax.random.key(1))
    with pytest.raises(ConfigError, match="exact sums"):
        validate_config(_config("scaffold", "user", "gaussian", "fixed", None))


# ------------------------------------- the audit: every algorithm × every DP/secure rule


def _loss(params, batch):
    logits = _apply(params, batch.x)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[..., None], -1)[..., 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def _private_and_secure_aggregators():
    """Every DP and secure aggregator of ``fedax.aggregators``, with its audit kind: the
    kinds every model-sized upload of a round through it must have; None where the audit
    cannot classify its release (a clip read from the aggregator's state, not a static
    bound of the ``dp_clip`` marker: the adaptive rules; codes uploaded and clipped again
    after decoding: ``dp_compressed``), whose ``private`` declaration and
    refusals are still checked."""
    from fedax import aggregators as agg
    from fedax.aggregators.compressors import cast

    secure = agg.secure_mean(CLIP, 100.0, bits=20)
    return {
        "dp_gaussian": (agg.dp_gaussian(CLIP, Z, M), {"dp"}),
        "dp_gaussian_secure": (agg.dp_gaussian(CLIP, Z, M, secure=20), {"secure+dp"}),
        "dp_adaptive_gaussian": (agg.dp_adaptive_gaussian(Z, M, clipped_count_stddev=M),
                                 None),
        "adaclip": (agg.adaclip(Z, M), None),
        "dp_compressed": (agg.dp_compressed(cast("bfloat16"), CLIP, Z, M), None),
        # (beside the noised sum, a secure sum of its 3 overflow and clip counters)
        "distributed_dp": (agg.distributed_dp(CLIP, Z, M, bits=20), {"secure+dp", "secure"}),
        "secure_mean": (secure, {"secure"}),
    }


def test_every_algorithm_with_every_private_or_secure_aggregator_uploads_only_covered_sums():
    """The audit of the traced round (``fed.audit_sums``, by dataflow): with each DP or
    secure aggregator, every registered algorithm is refused in one line exactly when its
    registry declares exact sums, and otherwise every upload of more than one number a
    client is the aggregator's DP or secure sum (the update among them); one number a
    client (a count, a reported training statistic, the adaptive clip's noised bit) is a
    round metric. The aggregator's
    ``private`` declaration is what the audit finds."""
    from fedax import federated as fed

    cohort = _cohort(np.random.default_rng(0), False)
    for (name, spec), (rule, (aggregator, kinds)) in itertools.product(
            ALGORITHMS.items(), _private_and_secure_aggregators().items()):
        where = f"{name} × {rule}"
        if spec.exact_sums:
            with pytest.raises(ValueError, match="exact sums beside the update"):
                spec(_loss, num_clients=N, client_lr=0.05, aggregator=aggregator)
            continue
        algorithm = spec(_loss, num_clients=N, client_lr=0.05, aggregator=aggregator)
        if kinds is None:
            assert aggregator.private, where
            continue
        state = algorithm.init(_params(), jax.random.key(0))
        audits = fed.audit_sums(jax.make_jaxpr(algorithm.round)(state, cohort,
                                                                jax.random.key(1)))
        model_sized = [a for a in audits if a.shape[1:] != ()]
        assert model_sized, where
        assert {a.kind for a in model_sized} <= kinds, (where, [(a.kind, a.shape)
                                                                 for a in model_sized])
        params = sum(leaf.size for leaf in jax.tree.leaves(_params()))
        released = sum(math.prod(a.shape[1:]) for a in model_sized if a.kind in kinds)
        assert released >= params, where  # the update itself goes up that way
        assert aggregator.private == any(a.private for a in audits), where


def test_an_algorithm_must_declare_what_it_uploads_and_keeps():
    from fedax.algorithms import AlgorithmSpec, register

    build = ALGORITHMS["fedavg"].build
    with pytest.raises(ValueError, match="must declare exact_sums and client_state"):
        AlgorithmSpec("mine", build)
    with pytest.raises(ValueError, match="must declare client_state"):
        AlgorithmSpec("mine", build, exact_sums=())
    with pytest.raises(ValueError, match="registered already"):
        register(AlgorithmSpec("fedavg", build, exact_sums=(), client_state=False))
    lying = AlgorithmSpec("mine", build, exact_sums=(), client_state=True)
    with pytest.raises(ValueError, match="declares client_state=True but its pieces keep "
                       "no per-client state"):
        lying(_loss, num_clients=N, client_lr=0.05)
    with pytest.raises(ValueError, match="keeps per-client state and needs num_clients"):
        ALGORITHMS["scaffold"](_loss, num_clients=None, client_lr=0.05)
