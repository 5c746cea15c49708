"""The one builder: an experiment's spec (a validated ``Config``, or a runtime ``Task``'s
names and numbers) becomes its algorithm, model and initial parameters here, and nowhere
else. The simulator (``run_experiment``), FedBuff (``execution.mode: async``) and the
networked runtime (``execution.mode: network``; a client rebuilds the task it is sent with
its own installed fedax) all call it, so the three engines run the same algorithm.

Names are looked up in the registries (``fedax.algorithms.ALGORITHMS``, the aggregator
kinds below, ``fedax.models``); no code comes with a spec.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import optax

from fedax.algorithms import ALGORITHMS, FederatedAlgorithm
from fedax.algorithms import make as make_algorithm
from fedax.client import Batches
from fedax.experiments.config import Config, ConfigError, resolved_server_optimizer
from fedax.experiments.features import robust_aggregator
from fedax.experiments.privacy_plan import PrivacyPlan, compressor, privacy_plan
from fedax.models import get_model, softmax_cross_entropy, with_precision


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
    its privacy plan (``client_sizes``, the n_k, are needed for example-level accounting
    only), else of its ``robust`` section, else the weighted mean."""
    import jax

    model = with_precision(get_model(config.model, **model_kwargs), config.precision)
    params = jax.jit(model.init)(jax.random.key(config.seed))
    plan = privacy_plan(config, num_clients, client_sizes)
    algorithm = build_algorithm(
        config, model.apply, sequence=sequence, num_clients=num_clients,
        aggregator=robust_aggregator(config) if plan is None else plan.aggregator,
        example_privacy=None if plan is None else plan.example_privacy,
        holdout_privacy=None if plan is None else plan.holdout)
    return Built(algorithm, model, params, plan)


def build_algorithm(config: Config, apply_fn, *, sequence: bool = False,
                    num_clients: int | None = None, aggregator: Any = None,
                    example_privacy: tuple[float, float] | None = None,
                    holdout_privacy: Any = None) -> FederatedAlgorithm:
    """The config's algorithm on ``apply_fn``'s model with the cross-entropy loss (per token,
    PAD targets ignored, when ``sequence``), with ``aggregator`` (default: the weighted
    mean). With ``server.lr: learned``, ``holdout_privacy`` (a ``HoldoutPrivacy``, from the
    run's privacy plan) privatizes the holdout hypergradient."""

    def loss_fn(params, batch: Batches):
        logits = apply_fn(params, batch.x)
        if sequence:
            from fedax.models.losses import token_cross_entropy

            return token_cross_entropy(logits, batch.y, batch.mask)
        return softmax_cross_entropy(logits, batch.y, batch.mask)

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
    if code is not None and config.compression.error_feedback:
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
                          "holdout privacy (fedax.experiments.privacy_plan)")

    return learned_server_lr_in_state(
        algorithm, server.hyperparameters["lr"], loss_fn,
        optax.adam(config.learned_lr.hyper_lr), config.learned_lr.mode)


def build_named(algorithm: str, loss_fn, *, num_clients: int, client_lr: float,
                aggregator: dict[str, Any] | None = None,
                example_privacy: tuple[float, float] | None = None,
                options: dict[str, Any] | None = None) -> FederatedAlgorithm:
    """A registered algorithm from names and numbers (a hand-written runtime ``Task``):
    ``ALGORITHMS[algorithm](loss_fn, ...)`` with the aggregator ``make_aggregator(spec)``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; allowed: "
                         f"{', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[algorithm](loss_fn, num_clients=num_clients, client_lr=client_lr,
                                 aggregator=make_aggregator(aggregator),
                                 example_privacy=example_privacy, **(options or {}))


def _aggregator_kinds() -> dict[str, Any]:
    from fedax import aggregators

    def dp_gaussian(clip, noise_multiplier, expected_clients=None, *, denominator=None,
                    per_layer=False, weighting="uniform", example_cap=None):
        if (expected_clients is None) == (denominator is None):
            raise TypeError("give exactly one of expected_clients (uniform weights) and "
                            "denominator (the fixed q·W)")
        d = expected_clients if denominator is None else denominator
        return aggregators.dp_gaussian(clip, noise_multiplier, d, per_layer=per_layer,
                                       weighting=weighting, example_cap=example_cap)

    def clip_norm(clip):
        return aggregators.chain(aggregators.clip_norm(clip), aggregators.mean())

    kinds = {
        "mean": aggregators.mean,
        "clip_norm": clip_norm,
        "dp_gaussian": dp_gaussian,
        "dp_adaptive_gaussian": aggregators.dp_adaptive_gaussian,
        "adaclip": aggregators.adaclip,
    }
    robust = getattr(aggregators, "robust", None)  # the robust rules, where installed
    if robust is not None:
        kinds["robust"] = robust
    return kinds


def make_aggregator(spec: dict[str, Any] | None) -> Any:
    """The ``fedax.aggregators`` aggregator a task's ``aggregator`` names (None: None, the
    algorithm's default). ``spec`` is ``{"kind": KIND, **arguments}``:

    * ``mean``: the weighted mean (FedAvg's);
    * ``clip_norm`` (``clip``): clip each update (the server does, per report), then the
      weighted mean;
    * ``dp_gaussian`` (``clip``, ``noise_multiplier``, ``expected_clients`` or
      ``denominator``; ``per_layer``, ``weighting``, ``example_cap``): DP-FedAvg with a
      fixed clip (``aggregators.dp_gaussian``);
    * ``dp_adaptive_gaussian`` (``noise_multiplier``, ``expected_clients``;
      ``initial_clip``, ``target_quantile``, ``learning_rate``, ``clipped_count_stddev``,
      ``geometric``): DP-FedAvg with the quantile-tracking clip;
    * ``adaclip`` (``noise_multiplier``, ``expected_clients``, ...): AdaCliP;
    * ``robust`` (``rule``, ``clip``, the rule's own arguments): ``aggregators.robust``
      (median, trimmed_mean, krum, multi_krum, geometric_median, norm_bounding).

    Names and numbers only, looked up here: no code comes with a task.
    """
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise ValueError(f'aggregator must be {{"kind": NAME, ...arguments}}, got {spec!r}')
    kinds = _aggregator_kinds()
    kind = spec["kind"]
    if kind not in kinds:
        raise ValueError(f"unknown aggregator kind {kind!r}; allowed: "
                         f"{', '.join(sorted(kinds))}")
    arguments = {k: v for k, v in spec.items() if k != "kind"}
    factory = kinds[kind]
    signature = inspect.signature(factory)
    try:
        signature.bind(**arguments)
    except TypeError as err:
        names = [p.name for p in signature.parameters.values()
                 if p.kind is not inspect.Parameter.VAR_KEYWORD]
        raise ValueError(f"aggregator {kind!r}: {err}; its arguments: "
                         f"{', '.join(names)}") from None
    try:
        return factory(**arguments)
    except TypeError as err:
        raise ValueError(f"aggregator {kind!r}: {err}") from None
