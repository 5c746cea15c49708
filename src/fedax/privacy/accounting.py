"""ε for DP-FedAvg (McMahan et al. 2018): Google's dp-accounting, not a hand-written accountant.

A round of user-level DP federated averaging samples a cohort, clips each client's update to
C, sums, and adds Gaussian noise of standard deviation z·C (z: the noise multiplier). Over T
rounds that is T compositions of the subsampled Gaussian mechanism, which ``dp_event``
writes as a dp-accounting ``DpEvent`` and ``epsilon`` hands to dp-accounting's RDP
accountant (Mironov's Rényi DP; conservative) or PLD accountant (privacy loss distributions;
tighter, slower). Which one produced a reported ε matters, so every function names it, and
``describe`` says in words what a figure assumes.

Sampling, and the neighbouring relation each one is accounted under:

* ``"poisson"`` (the default; McMahan et al.'s and TFF's): every client takes part in a round
  independently with probability q, so cohorts vary in size around q·N.
  ``PoissonSampledDpEvent(q, Gaussian(z))``, neighbours differ by adding or removing one
  client's data (ADD_OR_REMOVE_ONE). RDP and PLD.
* ``"fixed"``: each round draws exactly m = q·N of the N clients without replacement (what
  ``make_cohort`` does). dp-accounting accounts this only with RDP and only under
  REPLACE_ONE (neighbours differ by one client's data replaced, N public):
  ``SampledWithoutReplacementDpEvent(N, m, Gaussian(z/2))``. The z/2: a noise multiplier is
  the noise's standard deviation over the sensitivity, and replacing one client's clipped
  update moves the sum by up to 2C, not C. PLD has no event for it (a ValueError says so).

A round may release more than one Gaussian on the same cohort: ``noise_multiplier`` may be
a sequence of multipliers, one per release (adaptive quantile clipping's pair, see
``adaptive_clip_noise_multipliers``), and ``extra_releases_per_round`` adds that many more at
the round's effective multiplier (e.g. a reverse-mode hypergradient's extra clipped and
noised sum). Gaussian releases on the same sample compose to one Gaussian with
z = (Σ z_i⁻²)^(-1/2) (exactly: a vector of independent Gaussians), so the PLD accountant is
given that single Gaussian, while the RDP accountant is given the releases as a
``ComposedDpEvent`` and does the same reduction itself.

Nothing here imports JAX or the rest of fedax; the functions are pure and memoized. A run's
ε round by round (``PrivacyLedger``, ``ExampleLevelLedger``) is ``fedax.privacy.ledger``;
the noise multiplier for a target ε is ``fedax.privacy.calibration``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import warnings
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")
PLD_DISCRETIZATION = 1e-4  # dp-accounting's default value_discretization_interval


# ------------------------------------------------------------------------------ validation


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _multipliers(noise_multiplier) -> tuple[float, ...]:
    """The per-round noise multipliers as a tuple of floats, each finite and >= 0."""
    if isinstance(noise_multiplier, Sequence) and not isinstance(noise_multiplier, str):
        values = tuple(noise_multiplier)
        if not values:
            raise ValueError("noise_multiplier must be a number or a non-empty sequence of "
                             "numbers (one per Gaussian release in a round), got ()")
    else:
        values = (noise_multiplier,)
    out = []
    for z in values:
        z = _number("noise_multiplier", z)
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {z}")
        out.append(z)
    return tuple(out)


def _probability(q) -> float:
    q = _number("sampling_probability", q)
    if not 0 < q <= 1:
        raise ValueError(f"sampling_probability must be in (0, 1] (the fraction of clients "
                         f"sampled per round), got {q}")
    return q


def _rounds(rounds) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 0:
        raise ValueError(f"rounds must be a whole number >= 0, got {rounds!r}")
    return int(rounds)


def _delta(delta, population: int | None) -> float:
    delta = _number("delta", delta)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if population is not None and delta >= 1 / population:
        warnings.warn(
            f"delta = {delta:g} is not below 1/N = {1 / population:g} for a population of "
            f"N = {population} clients: an (epsilon, delta) guarantee with delta >= 1/N "
            "allows releasing one whole client's data; choose delta well below 1/N",
            UserWarning, stacklevel=3)
    return delta


def _population(population) -> int | None:
    if population is None:
        return None
    if isinstance(population, bool) or not isinstance(population, numbers.Integral) \
            or population < 1:
        raise ValueError(f"population must be a whole number of clients >= 1, got "
                         f"{population!r}")
    return int(population)


def _sample_size(q: float, sampling: str, population: int | None) -> int | None:
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if sampling == "poisson":
        return None
    if population is None:
        raise ValueError("fixed-size sampling needs population (N, the number of clients): "
                         "each round samples m = q*N of them without replacement")
    m = q * population
    if abs(m - round(m)) > 1e-9 * max(1.0, m) or round(m) < 1:
        raise ValueError(f"fixed-size sampling needs q*N to be a whole number of clients >= "
                         f"1; got q = {q:g}, N = {population} (q*N = {m:g})")
    return round(m)


def _extra(extra) -> int:
    if isinstance(extra, bool) or not isinstance(extra, numbers.Integral) or extra < 0:
        raise ValueError(f"extra_releases_per_round must be a whole number >= 0, got "
                         f"{extra!r}")
    return int(extra)


def _accountant_name(accountant: str, sampling: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got "
                         f"{accountant!r}")
    if accountant == "pld" and sampling == "fixed":
        raise ValueError("dp-accounting's PLD accountant has no event for fixed-size "
                         "sampling without replacement; use accountant='rdp' (REPLACE_ONE "
                         "neighbours) or Poisson sampling")
    return accountant


def _discretization(value) -> float:
    value = _number("pld_discretization", value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"pld_discretization must be a number > 0, got {value}")
    return value


def _common(noise_multiplier, sampling_probability, rounds, *, accountant, sampling,
            population, extra_releases_per_round, pld_discretization):
    zs = _multipliers(noise_multiplier)
    q = _probability(sampling_probability)
    population = _population(population)
    _sample_size(q, sampling, population)
    return (zs, q, _rounds(rounds), _accountant_name(accountant, sampling), sampling,
            population, _extra(extra_releases_per_round), _discretization(pld_discretization))


# ------------------------------------------------------------------------------ events


def effective_noise_multiplier(noise_multipliers) -> float:
    """The single Gaussian's multiplier equal to Gaussian releases with these multipliers
    (on the same data, each of sensitivity 1 in its own units): ``(Σ z_i⁻²)^(-1/2)``; 0 if
    any is 0 (a release without noise)."""
    zs = _multipliers(noise_multipliers)
    if any(z == 0 for z in zs):
        return 0.0
    return sum(z ** -2 for z in zs) ** -0.5


def adaptive_clip_noise_multipliers(noise_multiplier: float,
                                    clipped_count_stddev: float) -> tuple[float, float]:
    """Adaptive quantile clipping's pair of releases per round (Andrew et al.; TFF's
    ``gaussian_adaptive``), ``(z_Δ, 2σ_b)``, for a total multiplier z: the clipped sum gets
    ``z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2)`` and the count of unclipped clients, a sum of
    ``b_i − 0.5`` (sensitivity 0.5) with noise σ_b, has multiplier ``σ_b / 0.5 = 2σ_b``.
    Together they are one Gaussian with multiplier z. Needs ``z < 2σ_b`` (TFF raises too)."""
    z = _number("noise_multiplier", noise_multiplier)
    sigma_b = _number("clipped_count_stddev", clipped_count_stddev)
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {z}")
    if not (math.isfinite(sigma_b) and sigma_b > 0):
        raise ValueError(f"clipped_count_stddev must be a finite number > 0, got {sigma_b}")
    if z >= 2 * sigma_b:
        raise ValueError(f"adaptive clipping needs noise_multiplier < 2 * clipped_count_stddev"
                         f" (the count release alone would use the whole budget); got z = "
                         f"{z:g}, clipped_count_stddev = {sigma_b:g}")
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5, 2 * sigma_b


def _round_multipliers(zs: tuple[float, ...], extra: int) -> tuple[float, ...]:
    return zs + (effective_noise_multiplier(zs),) * extra


def _event(zs: tuple[float, ...], q: float, rounds: int, sampling: str, population,
           extra: int, single: bool) -> dp_accounting.DpEvent:
    """The event; ``single``: the round's releases as one Gaussian (the PLD accountant's
    sampled events take a Gaussian only)."""
    releases = _round_multipliers(zs, extra)
    if single:
        releases = (effective_noise_multiplier(releases),)
    if sampling == "fixed":  # REPLACE_ONE: a clipped sum's sensitivity is 2C
        releases = tuple(z / 2 for z in releases)
    gaussians = [dp_accounting.GaussianDpEvent(z) for z in releases]
    inner = gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)
    if sampling == "poisson":
        sampled = dp_accounting.PoissonSampledDpEvent(q, inner)
    else:
        sampled = dp_accounting.SampledWithoutReplacementDpEvent(
            population, _sample_size(q, sampling, population), inner)
    return dp_accounting.SelfComposedDpEvent(sampled, rounds)


def dp_event(noise_multiplier, sampling_probability: float, rounds: int, *,
             sampling: str = "poisson", population: int | None = None,
             extra_releases_per_round: int = 0) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``rounds`` rounds of the subsampled Gaussian mechanism.

    ``noise_multiplier``: z (noise standard deviation over the clip norm C), or one z per
    Gaussian release in a round (e.g. ``adaptive_clip_noise_multipliers(z, σ_b)``).
    ``sampling="poisson"``: ``PoissonSampledDpEvent(q, ·)``, for the ADD_OR_REMOVE_ONE
    relation. ``sampling="fixed"``: m = q·N of ``population`` N without replacement,
    ``SampledWithoutReplacementDpEvent(N, m, ·)`` with each multiplier halved, for the
    REPLACE_ONE relation (module docstring). ``extra_releases_per_round``: that many more
    Gaussian releases per round on the same cohort, at the round's effective multiplier.
    """
    zs, q, rounds, _, sampling, population, extra, _ = _common(
        noise_multiplier, sampling_probability, rounds, accountant="rdp", sampling=sampling,
        population=population, extra_releases_per_round=extra_releases_per_round,
        pld_discretization=PLD_DISCRETIZATION)
    return _event(zs, q, rounds, sampling, population, extra, single=False)


def _new_accountant(accountant: str, sampling: str, discretization: float):
    relation = (dp_accounting.NeighboringRelation.REPLACE_ONE if sampling == "fixed"
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    if accountant == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation)
    return pld.PLDAccountant(neighboring_relation=relation,
                             value_discretization_interval=discretization)


# ------------------------------------------------------------------------------ ε and z


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting logs (through absl) each fractional order whose series does not
    converge and leaves that order out; ε is then taken over the others, still a valid
    bound. Those lines would flood a run's output, so they are silenced here."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


@functools.lru_cache(maxsize=1024)
def _rdp_of_one_round(zs, q, sampling, population, extra):
    """dp-accounting's RDP accountant after one round: its orders and RDP values. T rounds
    have T times these values (the accountant itself multiplies by the count), so any T's ε
    is ``rdp.compute_epsilon`` of them, without recomputing the subsampled mechanism.

    A negative value is rounding error of an order at extreme noise (true RDP is >= 0), and
    dp-accounting's ``compute_epsilon`` would turn it into ε = 0, a guarantee nobody proved;
    such orders are left out here (their value set to inf), as it leaves out orders whose
    series does not converge."""
    acc = _new_accountant("rdp", sampling, PLD_DISCRETIZATION)
    with _quiet_absl():
        acc.compose(_event(zs, q, 1, sampling, population, extra, single=False))
    orders, values = acc.orders, np.where(acc.rdp < 0, np.inf, acc.rdp)
    orders.setflags(write=False)
    values.setflags(write=False)
    return orders, values


@functools.lru_cache(maxsize=4096)
def _epsilon(zs, q, rounds, delta, accountant, sampling, population, extra,
             discretization) -> float:
    if rounds == 0:
        return 0.0
    if effective_noise_multiplier(zs) == 0:
        return math.inf
    if accountant == "rdp":
        orders, values = _rdp_of_one_round(zs, q, sampling, population, extra)
        return float(rdp.compute_epsilon(orders, rounds * values, delta)[0])
    acc = _new_accountant(accountant, sampling, discretization)
    acc.compose(_event(zs, q, rounds, sampling, population, extra, single=True))
    return float(acc.get_epsilon(delta))


def epsilon(noise_multiplier, sampling_probability: float, rounds: int, delta: float, *,
            accountant: str = "rdp", sampling: str = "poisson",
            population: int | None = None, extra_releases_per_round: int = 0,
            pld_discretization: float = PLD_DISCRETIZATION) -> float:
    """ε after ``rounds`` rounds at ``delta``, from dp-accounting's RDP (``"rdp"``) or PLD
    (``"pld"``) accountant; arguments as in ``dp_event``. z = 0 gives inf, rounds = 0
    gives 0. ``population`` (N) is needed for fixed-size sampling; given with Poisson
    sampling it only checks δ < 1/N (a warning otherwise). ``pld_discretization``: the PLD
    accountant's value discretization (coarser is faster and slightly more pessimistic).
    Memoized."""
    args = _common(noise_multiplier, sampling_probability, rounds, accountant=accountant,
                   sampling=sampling, population=population,
                   extra_releases_per_round=extra_releases_per_round,
                   pld_discretization=pld_discretization)
    zs, q, rounds, accountant, sampling, population, extra, discretization = args
    delta = _delta(delta, population)
    return _epsilon(zs, q, rounds, delta, accountant, sampling, population, extra,
                    discretization)


# ------------------------------------------------------------------------------ words


def round_up(value: float, digits: int = 6) -> str:
    """``value`` to ``digits`` significant digits, rounded up: a printed ε never understates
    the privacy loss, nor a printed z the noise needed. 0 and inf as they are."""
    from decimal import ROUND_CEILING, Decimal

    if value == 0 or not value < float("inf"):
        return f"{value:g}"
    exact = Decimal(value)
    rounded = exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1),
                             rounding=ROUND_CEILING)
    rounded = rounded.normalize()
    return f"{rounded:f}" if abs(exact.adjusted()) < 6 else f"{rounded:g}"


def _dp_accounting_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dp-accounting")
    except PackageNotFoundError:  # pragma: no cover - installed without metadata
        return "unknown version"


def describe(noise_multiplier, sampling_probability: float, *, accountant: str = "rdp",
             sampling: str = "poisson", population: int | None = None,
             extra_releases_per_round: int = 0) -> str:
    """In one line, what an ε from these arguments assumes: the accountant, the sampling,
    the neighbouring relation and the releases per round."""
    zs, q, _, accountant, sampling, population, extra, _ = _common(
        noise_multiplier, sampling_probability, 0, accountant=accountant, sampling=sampling,
        population=population, extra_releases_per_round=extra_releases_per_round,
        pld_discretization=PLD_DISCRETIZATION)
    name = {"rdp": "RDP", "pld": "PLD"}[accountant]
    parts = [f"{name} accountant (dp-accounting {_dp_accounting_version()})"]
    if sampling == "poisson":
        parts.append(f"Poisson sampling, each client with q = {q:g} per round"
                     + (f" of N = {population}" if population is not None else ""))
        parts.append("neighbours add or remove one client's data (ADD_OR_REMOVE_ONE)")
    else:
        m = _sample_size(q, sampling, population)
        parts.append(f"fixed-size sampling, m = {m} of N = {population} clients without "
                     "replacement per round")
        parts.append("neighbours replace one client's data (REPLACE_ONE; the Gaussian "
                     "event carries z/2, a replaced update moving the sum by up to 2C)")
    releases = _round_multipliers(zs, extra)
    if len(releases) == 1:
        parts.append(f"one Gaussian release per round, z = {releases[0]:g}")
    else:
        listed = ", ".join(f"{z:g}" for z in releases)
        parts.append(f"{len(releases)} Gaussian releases per round (z = {listed}; together "
                     f"z = {effective_noise_multiplier(releases):g})")
    return "; ".join(parts)
