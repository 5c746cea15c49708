"""The one builder: an experiment's spec (a validated ``Config``; a runtime ``Task`` is a
config's task part) becomes its algorithm, model and initial parameters here, and nowhere
else. The simulator (``run_experiment``), FedBuff (``execution.mode: async``) and the
networked runtime (``execution.mode: network``; a client rebuilds the task it is sent with
its own installed fedax) all call it, so the three engines run the same algorithm.

Names are looked up in the registries (``fedax.algorithms.ALGORITHMS``, the server
optimizers, ``fedax.models``) and the config's aggregator sections (``privacy``, ``robust``,
``compression``); no code comes with a spec.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

from fedax.algorithms import ALGORITHMS, FederatedAlgorithm
from fedax.algorithms import make as make_algorithm
from fedax.builder.privacy_plan import PrivacyPlan, cohort_size, compressor, privacy_plan
from fedax.builder.secure_plan import secure_aggregator
from fedax.client import Batches
from fedax.models import get_model, softmax_cross_entropy, with_precision
from fedax.spec.config import Config, ConfigError, resolved_server_optimizer


class Built(NamedTuple):
    """What a spec builds: the algorithm, its model, the initial parameters
    ``model.init(key(seed))`` and the privacy plan (None without ``privacy``)."""

    algorithm: FederatedAlgorithm
    model: Any
    params: Any
    plan: PrivacyPlan | None


def build(config: Config, *, num_clients: int, model_kwargs: dict[str, Any],
          sequence: bool = False, client_sizes: Any = None) -> Built:
    """``config``'s algorithm for a population of ``num_clients`` on the model
    ``get_model(config.model, **model_kwargs)`` at ``config.precision``: the aggregator of
    its ``secure`` section (``fedax.builder.secure_plan``), else of its privacy plan
    (``client_sizes``, the n_k, are needed for example-level accounting and the secure
    mean's default largest weight), else of its ``robust`` section, else the weighted
    mean."""
    import jax

    model = with_precision(get_model(config.model, **model_kwargs), config.precision)
    params = jax.jit(model.init)(jax.random.key(config.seed))
    p = config.privacy
    plan: PrivacyPlan | None
    example_privacy: tuple[float, float] | None
    if p is not None and p.level == "example" and client_sizes is None:
        # a networked client trains with the mechanism; only the server accounts (it needs
        # the n_k, and the clients' noise is their own)
        assert p.clip is not None and p.noise_multiplier is not None  # validated for example
        plan, example_privacy = None, (float(p.clip), float(p.noise_multiplier))
    else:
        plan = privacy_plan(config, num_clients, client_sizes, dim=param_count(params))
        example_privacy = None if plan is None else plan.example_privacy
    if config.secure is not None:
        aggregator = secure_aggregator(config, client_sizes=client_sizes, plan=plan,
                                       cohort=cohort_size(config, num_clients))
    elif plan is None:
        aggregator = robust_aggregator(config)
    else:
        aggregator = privacy_aggregator(config, plan)
    algorithm = build_algorithm(
        config, model.apply, sequence=sequence, num_clients=num_clients,
        aggregator=aggregator,
        example_privacy=example_privacy,
        holdout_privacy=None if plan is None else plan.holdout)
    return Built(algorithm, model, params, plan)


def param_count(params: Any) -> int:
    """The number of coordinates of ``params`` (arrays or shape structs)."""
    import math

    import jax

    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def robust_aggregator(config: Config) -> Any:
    """The aggregator of ``config.robust`` (None without one: the weighted mean)."""
    if config.robust is None:
        return None
    from fedax import aggregators

    return aggregators.robust(config.robust.rule, clip=config.robust.clip,
                              **config.robust.options())


def privacy_aggregator(config: Config, plan: PrivacyPlan) -> Any:
    """The DP aggregator of ``config.privacy`` with its plan's z and fixed denominator m
    (None for example-level DP-SGD, which privatizes the local training instead):
    ``gaussian`` (DP-FedAvg; with ``compression``, each decoded message clipped again before
    the sum and the noise), ``adaptive`` (Andrew et al.'s quantile-tracking clip, σ_b the
    plan's) or ``adaclip``."""
    from fedax import aggregators

    p, z, m = config.privacy, plan.noise_multiplier, plan.expected_clients
    assert p is not None  # a plan is of config.privacy
    if p.level == "example":
        return None
    if p.mechanism == "gaussian" and config.compression is not None:
        assert p.clip is not None  # validated: mechanism 'gaussian' needs clip
        return aggregators.dp_compressed(compressor(config), p.clip, z, m,
                                         per_layer=p.per_layer)
    if p.mechanism == "gaussian":
        assert p.clip is not None
        return aggregators.dp_gaussian(p.clip, z, m, per_layer=p.per_layer)
    if p.mechanism == "adaptive":
        return aggregators.dp_adaptive_gaussian(
            z, m, initial_clip=p.clip or 0.1, target_quantile=p.target_quantile,
            learning_rate=p.clip_learning_rate, clipped_count_stddev=plan.count_stddev)
    return aggregators.adaclip(z, m, initial_clip=p.clip or 0.1,
                               clip_budget=p.clip if p.pin_scale else None)


def make_loss(apply_fn, sequence: bool = False):
    """The experiments' loss on ``apply_fn``'s model: the cross-entropy, per token with PAD
    targets ignored when ``sequence`` (the char-LSTM)."""

    def loss_fn(params, batch: Batches):
        logits = apply_fn(params, batch.x)
        if sequence:
            from fedax.models.losses import token_cross_entropy

            return token_cross_entropy(logits, batch.y, batch.mask)
        return softmax_cross_entropy(logits, batch.y, batch.mask)

    return loss_fn


def build_algorithm(config: Config, apply_fn, *, sequence: bool = False,
                    num_clients: int | None = None, aggregator: Any = None,
                    example_privacy: tuple[float, float] | None = None,
                    holdout_privacy: Any = None) -> FederatedAlgorithm:
    """The config's algorithm on ``apply_fn``'s model with the cross-entropy loss (per token,
    PAD targets ignored, when ``sequence``), with ``aggregator`` (default: the weighted
    mean). With ``server.lr: learned``, ``holdout_privacy`` (a ``HoldoutPrivacy``, from the
    run's privacy plan) privatizes the holdout hypergradient."""

    loss_fn = make_loss(apply_fn, sequence)
    # The registry entry's own options the config has (FedProx's mu), and its server
    # optimizer, every hyperparameter resolved (as summary.json records it).
    options = {k: getattr(config, k) for k in ALGORITHMS[config.algorithm].options
               if k in Config.model_fields}
    options.update(config.algorithm_options)
    server = resolved_server_optimizer(config)
    hyperparameters = dict(server.hyperparameters)
    code = compressor(config)
    if code is not None and aggregator is None:  # (a DP plan's aggregator compresses itself)
        from fedax.aggregators import compressed

        aggregator = compressed(code)
    elif code is not None and (config.privacy is None or config.privacy.level != "user"):
        raise ConfigError("config key 'compression': cannot compress under the given "
                          "aggregator (compression builds its own; with DP, privacy.mechanism "
                          "gaussian); drop one of the two")
    algorithm = make_algorithm(config.algorithm, loss_fn,
                               num_clients=num_clients or config.num_clients,
                               client_lr=config.client_lr, server_optimizer=server.name,
                               server_lr=hyperparameters.pop("lr"), **hyperparameters,
                               aggregator=aggregator, example_privacy=example_privacy,
                               local_stopping=config.client.stopping_rule(), **options)
    if code is not None and config.compression is not None \
            and config.compression.error_feedback:
        from fedax.algorithms.error_feedback import error_feedback

        algorithm = error_feedback(algorithm, code, num_clients or config.num_clients)
    if config.server.lr != "learned":
        return algorithm
    # η lives in the server optimizer's state; it is learned on holdout clients' loss.
    from fedax.hyper import learned_server_lr_in_state, private_learned_server_lr

    if holdout_privacy is not None:
        return private_learned_server_lr(
            algorithm, server.hyperparameters["lr"], loss_fn, holdout_privacy,
            optax.adam(config.learned_lr.hyper_lr), config.learned_lr.mode)
    if config.privacy is not None:
        raise ConfigError("config key 'server.lr': 'learned' with privacy needs the plan's "
                          "holdout privacy (fedax.builder.privacy_plan)")

    return learned_server_lr_in_state(
        algorithm, server.hyperparameters["lr"], loss_fn,
        optax.adam(config.learned_lr.hyper_lr), config.learned_lr.mode)
