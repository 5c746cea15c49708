"""A DP run's plan: its aggregator, its accountant, and exactly what its ε covers (and
``compressor``, the ``compression:`` section's compressor, which the DP aggregator may
carry).

Under ``privacy:`` every client-to-server upload of a round is one of

* a **Gaussian release** counted by the accountant: the clipped, noised sum of the updates
  (``dp_gaussian``, ``dp_compressed``; adaptive clipping's noised unclipped-count, composed
  with the update to the round's z; AdaCliP's whitened sum), and with
  ``server.lr: learned`` the holdout clients' clipped, noised hypergradient
  (``fedax.hyper.private_learned_server_lr``, one more release per round, counted with
  ``extra_releases_per_round``);
* a **diagnostic** the records carry beside the model (``train_loss``, ``local_steps``,
  ``clipped_clients``, ``rejected_clients``, ...): named in ``summary.json`` as not covered;
* anything else is **refused at config time** (``fedax.spec.config``, from what the
  registries declare: an algorithm's ``exact_sums``, its ``example_dp``), never run.

The neighbouring relation is the ledger's, one for every line of the summary: fixed-size
sampling is accounted under replace-one (N public), Poisson sampling under
add-or-remove-one client, example-level DP-SGD under add-or-remove-one example.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from fedax import data as fdata
from fedax.spec.config import Config, ConfigError

# Round metrics that are released privately (noised, or post-processing of noised values)
# or are public functions of the configuration; every other per-round column computed from
# client data is a diagnostic the summary lists as not covered.
PRIVATE_METRICS = frozenset({
    "dp_noise_stddev",  # z·S/D: public
    "clip_norm", "unclipped_fraction",  # adaptive clip: from the noised count
    "server_lr", "hypergradient", "hypergradient_norm",  # learned η: from noised releases
    "compression_ratio",  # a function of the model's shapes and the scheme: public
})
_EVALUATION_PREFIXES = ("test_", "client_accuracy", "backdoor_")
_BOOKKEEPING = frozenset({"round", "epsilon", "status", "elapsed_s", "wall_time_s"})

NEIGHBOURS = {
    "fixed": "replace-one client (REPLACE_ONE: N public, one client's data replaced)",
    "poisson": "add-or-remove-one client (ADD_OR_REMOVE_ONE)",
    "example": "add-or-remove-one example of one client (ADD_OR_REMOVE_ONE)",
}


class PrivacyPlan(NamedTuple):
    """A DP run's mechanism and accounting (its aggregator is built from it by
    ``fedax.builder.build.privacy_aggregator``).

    Attributes:
      noise_multiplier: z, given or calibrated to the budget.
      sampling_probability: q; expected_clients: m, the fixed denominator.
      ledger: ε after any number of rounds, every release of a round counted.
      rounds: the rounds the budget allows.
      example_privacy: ``(clip, z)`` of example-level DP-SGD, or None.
      holdout: the learned server lr's ``HoldoutPrivacy``, or None.
      releases: one phrase per Gaussian release of a round, in the summary's words.
      count_stddev: adaptive clipping's σ_b (its default filled in), or None.
    """

    noise_multiplier: float
    sampling_probability: float
    expected_clients: float
    ledger: Any
    rounds: int
    example_privacy: tuple[float, float] | None = None
    holdout: Any = None
    releases: tuple[str, ...] = ()
    count_stddev: float | None = None

    @property
    def neighbours(self) -> str:
        sampling = getattr(self.ledger, "sampling", None)
        return NEIGHBOURS["example" if sampling is None else sampling]

    def epsilon(self, rounds: int) -> float | None:
        """ε after ``rounds`` rounds; None where there is no guarantee (z = 0)."""
        value = self.ledger.epsilon_after(rounds)
        return value if math.isfinite(value) else None

    def summary(self, config: Config, rounds_run: int,
                last_record: dict[str, Any] | None = None) -> dict[str, Any]:
        p = config.privacy
        assert p is not None  # a plan is of a config with privacy
        out = {
            **p.model_dump(mode="json"), "noise_multiplier": self.noise_multiplier,
            "noise_multiplier_calibrated": p.noise_multiplier is None,
            "sampling_probability": self.sampling_probability,
            "expected_clients": self.expected_clients,
            # null: no guarantee (z = 0), not a diverged value
            "epsilon": self.epsilon(rounds_run),
            "rounds_within_budget": self.rounds,
            "stopped_by_budget": self.stopped_by_budget(config, rounds_run),
            "accounting": self.ledger.describe(),
            "neighbouring_relation": self.neighbours,
            "releases_per_round": len(self.releases),
            "epsilon_covers": [*self.releases, f"neighbours: {self.neighbours}"],
            "not_covered": _NOT_COVERED,
            "diagnostics_not_covered": diagnostics(last_record),
        }
        if self.count_stddev is not None:
            out["count_stddev"] = self.count_stddev
        return out

    def stopped_by_budget(self, config: Config, rounds_run: int) -> bool:
        """Whether the run ended because its next round would have exceeded the budget."""
        return self.rounds < config.rounds and rounds_run >= self.rounds

    def budget_line(self, config: Config, rounds_run: int) -> str | None:
        """The one line a budget stop prints, or None when the budget did not stop it."""
        if not self.stopped_by_budget(config, rounds_run):
            return None
        nxt = self.epsilon(rounds_run + 1)
        assert config.privacy is not None  # a plan is of a config with privacy
        return (f"stopped by the privacy budget after round {rounds_run} of {config.rounds}: "
                f"round {rounds_run + 1} would spend epsilon = "
                f"{'inf' if nxt is None else _round_up(nxt)} > privacy.target_epsilon = "
                f"{config.privacy.target_epsilon:g}")


_NOT_COVERED = (
    "the per-round client statistics in metrics.jsonl listed in diagnostics_not_covered "
    "are computed from client data without noise, and evaluation uses the server's test "
    "data: publish the model and epsilon, not those columns")


def console_lines(summary: dict[str, Any]) -> list[str]:
    """What ``fedax run`` prints about privacy beside its summary: ε with what it assumes,
    and the budget stop (``summary.json``'s ``privacy`` and ``stop_reason``)."""
    lines = []
    privacy = summary.get("privacy")
    if privacy:
        eps = privacy.get("epsilon")
        spent = ("no guarantee (noise multiplier 0)" if eps is None else
                 f"epsilon = {_round_up(eps)} at delta = {privacy['delta']:g}")
        lines.append(
            f"privacy: {spent} after {summary['rounds_run']} round(s) ({privacy['level']} "
            f"level, z = {privacy['noise_multiplier']:.4g}, {privacy['releases_per_round']} "
            f"release(s) a round, neighbours: "
            f"{privacy['neighbouring_relation'].split(' (')[0]}; summary.json privacy."
            "epsilon_covers lists them)")
    if summary.get("stop_reason"):
        lines.append(summary["stop_reason"])
    return lines


def diagnostics(record: dict[str, Any] | None) -> list[str]:
    """The round metrics of ``record`` that are computed from client data without noise."""
    if not record:
        return []
    return sorted(k for k in record if k not in PRIVATE_METRICS and k not in _BOOKKEEPING
                  and not k.startswith(_EVALUATION_PREFIXES))


def _round_up(value: float) -> str:
    """ε to 4 significant digits, rounded up (``fedax.privacy.round_up``)."""
    from fedax.privacy import round_up

    return round_up(value, 4)


def rounds_within_budget(config: Config, ledger: Any, spends: str, raise_what: str) -> int:
    """The rounds ``ledger`` allows within ``privacy.target_epsilon`` (``config.rounds``
    without a budget); a budget that one round already exceeds is refused in one line:
    "one round {spends} spends epsilon ... ; raise {raise_what} or the budget"."""
    p = config.privacy
    assert p is not None  # a DP run's
    if p.target_epsilon is None:
        return config.rounds
    rounds = ledger.rounds_within(p.target_epsilon, config.rounds)
    if rounds == 0:
        raise ConfigError(
            f"config key 'privacy.target_epsilon': one round {spends} spends epsilon "
            f"{ledger.epsilon_after(1):.3g} > {p.target_epsilon:g}; raise {raise_what} or "
            "the budget")
    return rounds


def compressor(config: Config) -> Any:
    """The ``compression:`` section's compressor (None without one); ``rotation`` is seeded
    with the run's seed."""
    c = config.compression
    if c is None:
        return None
    from fedax.aggregators import make_compressor

    return make_compressor(c.scheme, levels=c.levels, bits=c.bits, fraction=c.fraction,
                           bucket_size=c.bucket_size, block_size=c.block_size,
                           seed=config.seed)


def cohort_size(config: Config, num_clients: int) -> int:
    """m, the clients of a fixed-size cohort (``fedax.data.sample_clients``)."""
    return len(fdata.sample_clients(0, num_clients, config.client_fraction))


def count_stddev(config: Config, m: float, z: float) -> float:
    """Adaptive clipping's σ_b: the config's, or max(m/20, z). m/20 is TFF's default; it
    needs z < 2σ_b = m/10, which small cohorts miss (m = 10 at z = 1). With σ_b ≥ z the
    count never takes more than a quarter of the round's budget: z_Δ ≤ z/√0.75 ≈ 1.155 z."""
    assert config.privacy is not None  # adaptive clipping is a privacy mechanism
    given = config.privacy.count_stddev
    if given is not None:
        if z > 0 and not z < 2 * given:
            raise ConfigError(
                f"config key 'privacy.count_stddev': {given:g} is too small for noise "
                f"multiplier {z:.4g}: adaptive clipping needs z < 2*count_stddev (the "
                f"count's noise must leave budget for the update's); set it above {z / 2:.4g}"
                f" or omit it (default max(m/20, z) = {max(m / 20, z):.4g})")
        if z == 0 and given > 0:
            raise ConfigError("config key 'privacy.count_stddev': with noise multiplier 0 "
                              "nothing is private; omit count_stddev or set a noise "
                              "multiplier > 0")
        return float(given)
    return float(max(m / 20, z)) if z > 0 else 0.0


def privacy_plan(config: Config, num_clients: int,
                 client_sizes: Any = None, dim: int | None = None) -> PrivacyPlan | None:
    """The DP aggregator and accountant of ``config.privacy`` (None without one);
    ``client_sizes`` (n_k) for example-level accounting; ``dim``, the model's number of
    parameters, for distributed DP (its sensitivity after rounding grows with it). Raises
    ``ConfigError`` (exit 2) for what only the data's size can rule out (the budget,
    adaptive clipping's count noise, the learned η's holdout size)."""
    p = config.privacy
    if p is None:
        return None
    if p.level == "user" and p.mechanism in ("skellam", "discrete_gaussian"):
        return distributed_plan(config, num_clients, dim)
    from fedax.privacy import ExampleLevelLedger, PrivacyLedger, noise_multiplier_for

    if p.level == "example":
        if client_sizes is None:
            raise ValueError("example-level accounting needs the clients' sizes")
        # validated: level 'example' needs clip and noise_multiplier
        assert p.clip is not None and p.noise_multiplier is not None
        ledger: ExampleLevelLedger | PrivacyLedger = ExampleLevelLedger(
            p.noise_multiplier, client_sizes, config.batch_size, config.local_epochs, p.delta)
        rounds = rounds_within_budget(config, ledger, "already", "the noise")
        m: float = cohort_size(config, num_clients)
        example_releases = ("each local step's noised sum of per-example gradients clipped "
                            f"to {p.clip:g} (DP-SGD, z = {p.noise_multiplier:g}), every "
                            "client's every round",)
        return PrivacyPlan(float(p.noise_multiplier), m / num_clients, m, ledger,
                           rounds, (float(p.clip), float(p.noise_multiplier)),
                           releases=example_releases)

    if p.sampling == "fixed":
        m = cohort_size(config, num_clients)
        q = m / num_clients
    else:
        q = float(config.client_fraction)
        m = q * num_clients
    learned = config.server.lr == "learned"
    if learned:
        holdout = config.learned_lr.holdout_clients
        if holdout is not None and holdout != m:
            raise ConfigError(
                f"config key 'learned_lr.holdout_clients': with privacy the holdout cohort "
                f"must be drawn at the train cohort's rate (m = {m} of {num_clients}), so "
                f"that its hypergradient release is accounted at q = {q:g}; got {holdout}: "
                "omit it")
    # The learned η's holdout hypergradient: one more Gaussian release a round (forward
    # or reverse mode alike, the loss value is not released).
    extra = 1 if learned else 0
    z = p.noise_multiplier
    if z is None:
        assert p.target_epsilon is not None  # validated: z or a budget
        z = noise_multiplier_for(p.target_epsilon, q, config.rounds, p.delta,
                                 accountant=p.accountant, sampling=p.sampling,
                                 population=num_clients, extra_releases_per_round=extra)
    ledger = PrivacyLedger(z, q, p.delta, p.accountant, sampling=p.sampling,
                           population=num_clients, extra_releases_per_round=extra)
    rounds = rounds_within_budget(config, ledger, f"at noise_multiplier {z:g} already",
                                  "the noise")
    sigma_b = None
    update = f"the sum of the clients' updates, each clipped to {p.clip:g}" if p.clip else ""
    if p.mechanism == "gaussian" and config.compression is not None:
        releases = [f"{update} after decoding ({config.compression.scheme}), noised "
                    f"(Gaussian, z = {z:.4g})"]
    elif p.mechanism == "gaussian":
        releases = [f"{update}{' per layer' if p.per_layer else ''}, noised (Gaussian, "
                    f"z = {z:.4g})"]
    elif p.mechanism == "adaptive":
        sigma_b = count_stddev(config, m, z)
        releases = [f"the sum of the clients' updates clipped to the adaptive clip and the "
                    f"count of unclipped clients (noise {sigma_b:.4g}), noised together "
                    f"as one Gaussian of z = {z:.4g} (Andrew et al.)"]
    else:
        releases = [f"the sum of the clients' whitened updates clipped to norm 1, noised "
                    f"(Gaussian, z = {z:.4g}; AdaCliP)"]
    holdout_privacy = None
    if learned:
        from fedax.hyper import HoldoutPrivacy

        clip = config.learned_lr.clip
        holdout_privacy = HoldoutPrivacy(
            noise_multiplier=float(z), denominator=float(m), grad_clip=clip,
            tangent_clip=clip, release_loss=False)
        releases.append(f"the holdout clients' hypergradient of the server learning rate "
                        f"({config.learned_lr.mode} mode), each client's clipped to "
                        f"{clip:g}, noised (Gaussian, z = {z:.4g}); the holdout cohort is "
                        "sampled like the train cohort and counted on its sample (an upper "
                        "bound)")
    return PrivacyPlan(float(z), q, m, ledger, rounds, holdout=holdout_privacy,
                       releases=tuple(releases), count_stddev=sigma_b)


class DistributedLedger:
    """ε of distributed DP (``fedax.privacy.distributed``): T rounds of the summed
    Skellam or discrete Gaussian noise, RDP composed without subsampling amplification
    (the cohort's realised noise is what the clients add), converted at δ."""

    sampling = "fixed"

    def __init__(self, params: Any, delta: float):
        self.params, self.delta = params, float(delta)
        self.noise_multiplier = params.noise_multiplier

    def epsilon_after(self, rounds: int) -> float:
        from fedax.privacy.distributed import distributed_epsilon

        return distributed_epsilon(self.params, int(rounds), self.delta)

    def rounds_within(self, target_epsilon: float, max_rounds: int | None = None) -> int:
        """The most rounds (at most ``max_rounds``) whose ε stays within the target."""
        low, high = 0, int(max_rounds or 10_000)
        while low < high:  # ε grows with the rounds
            mid = (low + high + 1) // 2
            if self.epsilon_after(mid) <= target_epsilon:
                low = mid
            else:
                high = mid - 1
        return low

    def describe(self) -> str:
        q = self.params
        return (f"distributed {q.mechanism} (Agarwal et al. 2021 / Kairouz et al. 2021 RDP "
                f"bound), {q.expected_clients} clients each adding variance "
                f"{q.local_variance:.4g} at scale {q.scale:.4g}, {q.bits} bits, L2 "
                f"sensitivity {q.l2_sensitivity:.4g} after rounding; RDP composed over rounds "
                "without subsampling amplification; assumes every client adds its share "
                "(the server sees only the masked sum and cannot check): with m of the n "
                "shares missing the noise multiplier is z*sqrt(1 - m/n), "
                f"{self.noise_multiplier * math.sqrt(1 - 1 / q.expected_clients):.4g} "
                f"for one missing share of {q.expected_clients}")


def distributed_plan(config: Any, num_clients: int, dim: int | None) -> Any:
    """The plan of distributed DP: the config's z (a target alone is refused: give
    noise_multiplier), the cohort m as the denominator, ε from ``DistributedLedger``."""
    from fedax.aggregators.distributed_dp import distributed_dp_params

    p = config.privacy
    if p.noise_multiplier is None:
        raise ConfigError(f"config key 'privacy.noise_multiplier': mechanism {p.mechanism!r} "
                          "needs it given (target_epsilon alone is calibrated for the central "
                          "Gaussian only); target_epsilon still stops the run at its budget")
    if dim is None:
        raise ValueError("distributed DP accounting needs the model's number of parameters")
    m = cohort_size(config, num_clients)
    try:
        params = distributed_dp_params(float(p.clip), float(p.noise_multiplier), m, dim,
                                       bits=config.secure.bits, mechanism=p.mechanism)
    except ValueError as err:
        raise ConfigError(f"config key 'secure.bits': {err}") from None
    ledger = DistributedLedger(params, p.delta)
    rounds = rounds_within_budget(config, ledger, "already", "the noise, the bits")
    releases = (f"the modular sum of the clients' updates, each clipped to {p.clip:g}, "
                f"rotated, scaled by {params.scale:.4g}, rounded and noised on the client "
                f"({p.mechanism}, local variance {params.local_variance:.4g}; summed: "
                f"z = {p.noise_multiplier:g}), through secure aggregation mod 2^"
                f"{config.secure.bits}",)
    return PrivacyPlan(float(p.noise_multiplier), m / num_clients, m, ledger, rounds,
                       releases=releases)
