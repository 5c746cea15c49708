"""The sections of an experiment config that change what the server aggregates: privacy
(``PrivacyConfig``), a compressed uplink (``CompressionConfig``), secure aggregation
(``SecureConfig``), a robust aggregator (``RobustConfig``) and the simulated attackers it
is meant to withstand (``AttackConfig``); each a strict pydantic model whose validator
checks the keys that go together (``fedax.spec.sections`` has the others)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fedax.spec.sections import Number, _KeyedError, _Section


class PrivacyConfig(_Section):
    """User-level DP-FedAvg (McMahan et al. 2018): the aggregator clips each client's update
    and noises the sum (``fedax.aggregators``), and ``fedax.privacy`` reports ε. With
    ``level: example``, each client instead trains with DP-SGD (per-example ``clip`` and
    ``noise_multiplier``, ``fedax.client.dp_local_train``; FedAvg, FedProx, FedOpt) and ε is
    example-level (``fedax.privacy.ExampleLevelLedger``).

    ``mechanism``: ``gaussian`` (a fixed clip ``clip``, flat or ``per_layer``), ``adaptive``
    (Andrew et al.'s quantile-tracking clip from ``clip``, default 0.1, towards
    ``target_quantile`` at ``clip_learning_rate``, the count noised with ``count_stddev``,
    default max(m/20, z): it must exceed z/2, and m/20 alone does not on small cohorts) or
    ``adaclip`` (coordinate-wise, from ``clip``; ``pin_scale: true`` pins
    its scale at ``clip`` so that only the allocation over coordinates adapts, the stable
    choice when d·z²/m > 1), or distributed DP with a ``secure`` section: ``skellam`` or
    ``discrete_gaussian`` noise added by each client to its quantized update before the
    secure sum (Kairouz et al. 2021; Agarwal et al. 2021). ``noise_multiplier`` z,
    or ``target_epsilon`` alone (then z is the smallest that keeps ``rounds`` rounds within
    it); with both, the run stops before the round that would exceed the budget.
    ``sampling``: ``fixed`` (the cohort of ``client_fraction``·N clients, as without DP;
    accounted as sampling without replacement, replace-one neighbours) or ``poisson`` (each
    client joins with probability ``client_fraction``; add-or-remove-one neighbours).
    The denominator of the average is the expected cohort size m.

    Every upload of a round is privatized and counted, or the run is refused here
    (``private_combination``): an algorithm that uploads exact sums beside its update
    (SCAFFOLD, FedNova: their registry's ``exact_sums``) cannot run under user-level DP,
    and ``server.lr: learned`` privatizes its holdout hypergradient (``learned_lr.clip``),
    one more release a round (``fedax.builder.privacy_plan``)."""

    level: Literal["user", "example"] = "user"
    mechanism: Literal["gaussian", "adaptive", "adaclip", "skellam",
                       "discrete_gaussian"] | None = None
    noise_multiplier: Number | None = Field(None, ge=0, allow_inf_nan=False)
    target_epsilon: Number | None = Field(None, gt=0, allow_inf_nan=False)
    delta: Number = Field(1e-5, gt=0, lt=1)
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)
    per_layer: bool = False
    pin_scale: bool = False
    target_quantile: Number = Field(0.5, ge=0, le=1)
    clip_learning_rate: Number = Field(0.2, ge=0, allow_inf_nan=False)
    count_stddev: Number | None = Field(None, ge=0, allow_inf_nan=False)
    accountant: Literal["rdp", "pld"] = "rdp"
    sampling: Literal["fixed", "poisson"] = "fixed"

    @model_validator(mode="after")
    def _consistent(self) -> PrivacyConfig:
        if self.level == "example":
            for key in ("mechanism", "count_stddev"):
                if getattr(self, key) is not None:
                    raise _KeyedError(f"privacy.{key}", "applies to level 'user' only (level "
                                                        "'example' is DP-SGD in local training)")
            if self.per_layer or self.sampling != "fixed" or self.accountant != "rdp":
                raise _KeyedError("privacy.level", "level 'example' takes clip, "
                                                   "noise_multiplier, target_epsilon and delta "
                                                   "only (RDP, every round counted)")
            if self.clip is None or self.noise_multiplier is None:
                raise _KeyedError("privacy.clip" if self.clip is None else
                                  "privacy.noise_multiplier",
                                  "level 'example' needs clip (per-example L2 bound) and "
                                  "noise_multiplier")
            return self
        if self.mechanism is None:
            raise _KeyedError("privacy.mechanism", "level 'user' needs a mechanism: gaussian, "
                                                   "adaptive, adaclip, skellam or "
                                                   "discrete_gaussian")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise _KeyedError("privacy.noise_multiplier", "give noise_multiplier (z >= 0) or "
                                                          "target_epsilon (or both)")
        if self.mechanism in ("gaussian", "skellam", "discrete_gaussian") and self.clip is None:
            raise _KeyedError("privacy.clip", f"mechanism {self.mechanism!r} needs clip (S > 0)")
        if self.per_layer and self.mechanism != "gaussian":
            raise _KeyedError("privacy.per_layer", "applies to mechanism 'gaussian' only")
        if self.pin_scale and (self.mechanism != "adaclip" or self.clip is None):
            raise _KeyedError("privacy.pin_scale", "applies to mechanism 'adaclip' with a "
                                                   "clip (the pinned scale)")
        if self.mechanism != "adaptive":
            for key in ("count_stddev",):
                if getattr(self, key) is not None:
                    raise _KeyedError(f"privacy.{key}", "applies to mechanism 'adaptive' only")
        if self.mechanism == "adaptive" and self.count_stddev is not None \
                and self.noise_multiplier is not None and self.noise_multiplier > 0 \
                and not self.noise_multiplier < 2 * self.count_stddev:
            raise _KeyedError(
                "privacy.count_stddev", f"{self.count_stddev:g} is too small for "
                f"noise_multiplier {self.noise_multiplier:g}: adaptive clipping needs z < "
                f"2*count_stddev (the count's noise must leave budget for the update's); "
                f"set it above {self.noise_multiplier / 2:g} or omit it (default "
                "max(m/20, z))")
        if self.accountant == "pld" and self.sampling == "fixed":
            raise _KeyedError("privacy.accountant", "'pld' needs sampling: poisson "
                                                    "(dp-accounting has no PLD for sampling "
                                                    "without replacement); use 'rdp'")
        return self


class CompressionConfig(_Section):
    """A compressed uplink (``fedax.aggregators.compression``): each client encodes its
    update, the server decodes and averages. ``scheme``: ``qsgd`` (Alistarh et al.; s =
    ``levels`` per sign, ⌈log₂(2s+1)⌉ bits a coordinate, a norm per ``bucket_size``),
    ``rotation`` (Suresh et al.; randomized Hadamard over ``block_size`` blocks + ``bits``-bit
    stochastic quantization), ``top_k`` (the ``fraction`` of largest coordinates per leaf),
    ``float16``, ``bfloat16`` or ``int8`` (per-bucket scale). ``error_feedback`` keeps each
    client's residual as per-client state (deterministic schemes only). With ``privacy``
    (mechanism ``gaussian``) each decoded message is clipped to ``privacy.clip`` again on the
    server before the sum and the noise, which keeps the sensitivity (``dp_compressed``)."""

    scheme: Literal["qsgd", "rotation", "top_k", "float16", "bfloat16", "int8"]
    levels: int | None = Field(None, ge=1, le=2**15)  # qsgd
    bits: int | None = Field(None, ge=1, le=16)  # rotation
    fraction: Number | None = Field(None, gt=0, le=1)  # top_k
    error_feedback: bool = False
    bucket_size: int = Field(512, ge=1)  # qsgd, int8
    block_size: int = Field(4096, ge=2)  # rotation

    @model_validator(mode="after")
    def _consistent(self) -> CompressionConfig:
        needs = {"qsgd": "levels", "rotation": "bits", "top_k": "fraction"}
        for scheme, key in needs.items():
            given = getattr(self, key) is not None
            if self.scheme == scheme and not given:
                raise _KeyedError(f"compression.{key}", f"scheme {scheme!r} needs {key}")
            if self.scheme != scheme and given:
                raise _KeyedError(f"compression.{key}", f"applies to scheme {scheme!r} only")
        if self.error_feedback and self.scheme in ("qsgd", "rotation"):
            raise _KeyedError("compression.error_feedback",
                              f"applies to the deterministic schemes (top_k, float16, "
                              f"bfloat16, int8); {self.scheme!r} is unbiased: omit it")
        if self.block_size & (self.block_size - 1):
            raise _KeyedError("compression.block_size",
                              f"must be a power of 2, got {self.block_size}")
        return self


class SecureConfig(_Section):
    """Secure aggregation (Bonawitz et al. 2017; SecAgg+, Bell et al. 2020): the server
    learns only the sum of the clients' quantized updates (``fedax.aggregators.secure``;
    docs/secure-aggregation.md). Each coordinate is clipped to [−``clip``, ``clip``],
    rounded stochastically to ``levels`` steps per side (default: the most the cohort
    allows without wrap-around, at most 2^22) and summed mod 2^``bits``; a cohort whose sum
    could wrap is refused. Without ``privacy`` it is FedAvg's weighted mean, each weight
    n_k/``max_weight`` capped at 1 (default ``max_weight``: the largest n_k of the data; the
    network engine needs it given). With ``privacy.mechanism: gaussian`` the server noises
    the secure sum (``clip`` defaults to privacy.clip); with ``skellam`` or
    ``discrete_gaussian`` each client noises its own integers (distributed DP), so no party
    sees an unnoised sum. In simulation the primitive's exact arithmetic runs; over the
    network the SecAgg+ protocol (``num_shares`` k, the neighbourhood a client shares its
    secrets with, itself included; ``threshold`` t of them to unmask; defaults:
    min(n, 2⌈log2 n⌉+1), odd, and max(⌊k/2⌋+1, ⌊2k/3⌋): more than half, so that a server
    lying about drop-outs cannot gather both secrets of one client). With a roster of the
    clients' identity keys (docs/deployment.md) the consistency check needs ``signers``
    survivors' signatures, default ⌊n/2⌋+1 of the n selected; against a server colluding
    with c clients take more than (n + c)/2."""

    bits: int = Field(32, ge=1, le=32)
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)
    levels: int | None = Field(None, ge=1)
    max_weight: Number | None = Field(None, gt=0, allow_inf_nan=False)
    num_shares: int | None = Field(None, ge=3)
    threshold: int | None = Field(None, ge=2)
    signers: int | None = Field(None, ge=2)


class RobustConfig(_Section):
    """A robust aggregator (``fedax.aggregators.robust``; docs/references.md, robust aggregation and
    attacks) instead of the weighted mean: ``rule`` ``median`` or ``trimmed_mean`` (``beta``: ⌊β·n⌋
    cut per end; Yin et al.), ``krum`` (``byzantine`` f) or ``multi_krum`` (f and ``keep`` m;
    Blanchard et al.), ``geometric_median`` (RFA's smoothed Weiszfeld, ``iterations``,
    ``smoothing``; Pillutla et al.) or ``norm_bounding`` (clip to ``norm_bound`` M, then the mean,
    with ``noise_stddev`` the "weak DP" noise; Sun et al.). ``clip``: clip each update to this norm
    first (a client stage before the rule). With ``privacy`` it is an error: DP noise needs a sum
    (see ``fedax.aggregators.check_private_reduction``)."""

    rule: Literal["median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
                  "norm_bounding"]
    beta: Number | None = Field(None, ge=0, lt=0.5)  # trimmed_mean
    byzantine: int | None = Field(None, ge=0)  # krum, multi_krum
    keep: int | None = Field(None, ge=1)  # multi_krum
    norm_bound: Number | None = Field(None, gt=0, allow_inf_nan=False)  # norm_bounding
    noise_stddev: Number | None = Field(None, ge=0, allow_inf_nan=False)  # norm_bounding
    iterations: int | None = Field(None, ge=0)  # geometric_median (default 4)
    smoothing: Number | None = Field(None, gt=0, allow_inf_nan=False)  # geometric_median
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> RobustConfig:
        needs = {"trimmed_mean": ("beta",), "krum": ("byzantine",),
                 "multi_krum": ("byzantine", "keep"), "norm_bounding": ("norm_bound",)}
        optional = {"noise_stddev": ("norm_bounding",), "iterations": ("geometric_median",),
                    "smoothing": ("geometric_median",)}
        for key in ("beta", "byzantine", "keep", "norm_bound", *optional):
            rules = [r for r, keys in needs.items() if key in keys] or list(optional[key])
            given = getattr(self, key) is not None
            if given and self.rule not in rules:
                raise _KeyedError(f"robust.{key}",
                                  f"applies to rule {' or '.join(map(repr, rules))} only")
            if not given and key in needs.get(self.rule, ()):
                raise _KeyedError(f"robust.{key}", f"rule {self.rule!r} needs {key}")
        return self

    def options(self) -> dict[str, Any]:
        """The rule's keyword arguments for ``fedax.aggregators.robust``."""
        names = {"beta": "beta", "byzantine": "byzantine", "keep": "keep",
                 "norm_bound": "max_norm", "noise_stddev": "noise_stddev",
                 "iterations": "iterations", "smoothing": "smoothing"}
        return {names[k]: getattr(self, k) for k in names if getattr(self, k) is not None}


class AttackConfig(_Section):
    """Simulated attackers (``fedax.attacks``; docs/references.md, robust aggregation and attacks):
    a ``fraction`` of the population, chosen by ``seed`` (default: the run's seed), misbehaves every
    round it is sampled. ``kind``: ``label_flip`` (train on y' = K−1−y), ``backdoor`` (a fraction
    ``poison_fraction`` of their examples carry a 4×4 trigger and label ``target``; with ``scale``,
    the update is boosted by λ after projecting to ``project``; the records get
    ``backdoor_success``), ``sign_flip`` (−μ of the honest updates), ``scaled`` (λ·Δ, ``scale`` λ
    default: clients per round, ``project``), ``gaussian`` (N(0, ``stddev``²)), ``alie`` (μ − zσ,
    ``z`` default Baruch et al.'s z_max) or ``ipm`` (−``epsilon``·μ)."""

    kind: Literal["label_flip", "backdoor", "sign_flip", "scaled", "gaussian", "alie", "ipm"]
    fraction: Number = Field(ge=0, lt=1)
    seed: int | None = None
    scale: Number | None = Field(None, allow_inf_nan=False)  # scaled, backdoor
    project: Number | None = Field(None, gt=0, allow_inf_nan=False)  # scaled, backdoor
    stddev: Number | None = Field(None, ge=0, allow_inf_nan=False)  # gaussian
    z: Number | None = Field(None, allow_inf_nan=False)  # alie
    epsilon: Number | None = Field(None, gt=0, allow_inf_nan=False)  # ipm
    target: int | None = Field(None, ge=0)  # backdoor
    poison_fraction: Number | None = Field(None, gt=0, le=1)  # backdoor

    @model_validator(mode="after")
    def _consistent(self) -> AttackConfig:
        applies = {"scale": ("scaled", "backdoor"), "project": ("scaled", "backdoor"),
                   "stddev": ("gaussian",), "z": ("alie",), "epsilon": ("ipm",),
                   "target": ("backdoor",), "poison_fraction": ("backdoor",)}
        for key, kinds in applies.items():
            if getattr(self, key) is not None and self.kind not in kinds:
                raise _KeyedError(f"attack.{key}",
                                  f"applies to kind {' or '.join(map(repr, kinds))} only")
        return self
