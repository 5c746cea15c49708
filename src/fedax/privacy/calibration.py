"""The noise multiplier for a target ε: a search with dp-accounting's mechanism calibration
over a bracket found by doubling, that says how it ended (``NoiseSearch``): the target
reached, the accountant's floor (ε stops falling with z), or its upper bound of z hit.
Accounting itself (the events, ε) is ``fedax.privacy.accounting``."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from dp_accounting import mechanism_calibration

from fedax.privacy.accounting import (
    PLD_DISCRETIZATION,
    _common,
    _delta,
    _epsilon,
    _event,
    _new_accountant,
    _number,
    _quiet_absl,
)

# The largest noise multiplier the search for z tries (2^20 ≈ 1.05e6, reached by doubling
# from 1). Far beyond any useful z, and below where dp-accounting's RDP arithmetic breaks
# down (negative or infinite RDP near z = 1e8, a math domain error for sampling without
# replacement near z = 1e12).
MAX_NOISE_MULTIPLIER = 2.0 ** 20
_MAX_DOUBLINGS = 64


class NoiseSearchWarning(UserWarning):
    """``noise_multiplier_for``'s z meets the target only past the accountant's floor, not
    by calibration (``NoiseSearch.below_floor``; the message holds the numbers). A target no
    z up to the search's upper bound reaches is a ValueError instead."""


@dataclass(frozen=True)
class NoiseSearch:
    """What ``search_noise_multiplier`` found.

    Attributes:
      noise_multiplier: the smallest z found whose ε is at most ``target_epsilon``; the
        upper bound itself when even that z does not reach the target (``hit_upper_bound``).
      epsilon: ε at ``noise_multiplier``.
      target_epsilon: the target.
      upper_bound: the largest z the search tries (``MAX_NOISE_MULTIPLIER`` by default).
      hit_upper_bound: ε is still above the target at ``upper_bound``: no z up to it
        reaches the target, which may be unreachable at these q, T and δ.
      below_floor: ``(z, ε)`` at the largest z tried below ``noise_multiplier`` (ε above
        the target there) when the search met the accountant's floor: doubling z lowered ε
        by less than 10% (the subsampled Gaussian's ε falls about as 1/z; the RDP
        accountant's stops falling at a floor set by its largest order and δ), or ε jumped
        from above the target to below half of it (RDP's drops to 0 once the releases'
        divergence is below δ²). z then meets the target by the accountant's rule but is
        not a calibration: far more noise than a tighter analysis would need. None
        otherwise.
      q, rounds, delta, accountant: what was searched, for the messages.
    """

    noise_multiplier: float
    epsilon: float
    target_epsilon: float
    upper_bound: float
    hit_upper_bound: bool
    below_floor: tuple[float, float] | None
    q: float
    rounds: int
    delta: float
    accountant: str

    @property
    def reached(self) -> bool:
        """Whether ``noise_multiplier``'s ε is at most the target."""
        return self.epsilon <= self.target_epsilon

    def _setting(self) -> str:
        return (f"q = {self.q:g}, T = {self.rounds}, delta = {self.delta:g} with the "
                f"{self.accountant.upper()} accountant")

    @property
    def warning(self) -> str | None:
        """One line on how the search ended, if not at a calibrated z; else None."""
        if self.hit_upper_bound:
            return (f"the search for the noise multiplier hit its upper bound of z = "
                    f"{self.upper_bound:g}: epsilon is still {self.epsilon:.6g} there, above "
                    f"the target {self.target_epsilon:g}; the epsilon target may be "
                    f"unreachable at {self._setting()}")
        if self.below_floor is not None:
            z_below, eps_below = self.below_floor
            why = (", where RDP's conversion gives 0 (the releases within delta of not "
                   "depending on any one client)"
                   if self.accountant == "rdp" and self.epsilon == 0 else "")
            return (f"the search for the noise multiplier hit the accountant's floor: "
                    f"epsilon hardly falls as z grows (still {eps_below:.6g} at z = "
                    f"{z_below:.6g}) and is {self.epsilon:.6g} <= {self.target_epsilon:g} "
                    f"only at z = {self.noise_multiplier:.6g}{why}; that z is set by the "
                    f"accountant's floor, not calibrated, and far more noise than a tighter "
                    f"analysis needs: the epsilon target may be out of reach at "
                    f"{self._setting()}")
        return None

    @property
    def error(self) -> str:
        """Why no z was found (for ``hit_upper_bound``)."""
        return (f"no noise multiplier up to {self.upper_bound:g} reaches epsilon "
                f"{self.target_epsilon:g} at {self._setting()} (epsilon at "
                f"{self.upper_bound:g}: {self.epsilon:.6g})")


def search_noise_multiplier(target_epsilon: float, sampling_probability: float, rounds: int,
                            delta: float, *, accountant: str = "rdp",
                            sampling: str = "poisson", population: int | None = None,
                            extra_releases_per_round: int = 0,
                            pld_discretization: float = PLD_DISCRETIZATION,
                            tol: float | None = None,
                            max_noise_multiplier: float | None = None) -> NoiseSearch:
    """``noise_multiplier_for``'s search, with how it ended: a ``NoiseSearch`` holding z, its
    ε, and whether the search hit its upper bound of z (``max_noise_multiplier``, default
    ``MAX_NOISE_MULTIPLIER``) or met the target only past a jump of ε. Never raises for an
    unreachable target (``hit_upper_bound`` says so); raises ValueError for bad arguments."""
    target = _number("target_epsilon", target_epsilon)
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target}")
    args = _common(1.0, sampling_probability, rounds, accountant=accountant,
                   sampling=sampling, population=population,
                   extra_releases_per_round=extra_releases_per_round,
                   pld_discretization=pld_discretization)
    _, q, rounds, accountant, sampling, population, extra, discretization = args
    delta = _delta(delta, population)
    if tol is not None and not (_number("tol", tol) > 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a finite number > 0, got {tol}")
    bound = MAX_NOISE_MULTIPLIER if max_noise_multiplier is None else _number(
        "max_noise_multiplier", max_noise_multiplier)
    if not (math.isfinite(bound) and bound >= 1):
        raise ValueError(f"max_noise_multiplier must be a finite number >= 1, got {bound}")

    def eps(z: float) -> float:
        return _epsilon((z,), q, rounds, delta, accountant, sampling, population, extra,
                        discretization)

    def found(z: float, hit: bool = False, floor=None) -> NoiseSearch:
        return NoiseSearch(float(z), eps(z), target, bound, hit, floor, q, rounds, delta,
                           accountant)

    if rounds == 0:
        return found(0.0)
    lo, hi = 0.5, 1.0
    flat = False  # a doubling of z that lowered ε by less than 10%: the accountant's floor
    if eps(hi) > target:
        while True:
            lo, hi = hi, min(2 * hi, bound)
            flat = flat or eps(hi) > 0.9 * eps(lo)
            if eps(hi) <= target:
                break
            if hi >= bound:
                return found(bound, hit=True)
    else:
        for _ in range(_MAX_DOUBLINGS):
            if eps(lo) > target:
                break
            hi, lo = lo, lo / 2
        else:
            return found(hi)  # ε <= target at every z tried: essentially no noise is needed
    with _quiet_absl():
        z = float(mechanism_calibration.calibrate_dp_mechanism(
            lambda: _new_accountant(accountant, sampling, discretization),
            lambda z: _event((z,), q, rounds, sampling, population, extra,
                             single=accountant == "pld"),
            target, delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(lo, hi),
            tol=tol if tol is not None else 1e-6 * hi))
    if not eps(z) <= target:  # dp-accounting's ε and ours disagree (left-out orders): be safe
        z = hi
    # A calibrated z has ε within the tolerance of the target; one far below it was found
    # past a jump of the accountant's ε, which the bracket's lower end (ε > target) shows.
    return found(z, floor=(lo, eps(lo)) if flat or eps(z) < target / 2 else None)


def noise_multiplier_for(target_epsilon: float, sampling_probability: float, rounds: int,
                         delta: float, *, accountant: str = "rdp", sampling: str = "poisson",
                         population: int | None = None, extra_releases_per_round: int = 0,
                         pld_discretization: float = PLD_DISCRETIZATION,
                         tol: float | None = None,
                         max_noise_multiplier: float | None = None) -> float:
    """The smallest noise multiplier z (to within ``tol``, default 1e-6·z) whose ``epsilon``
    is at most ``target_epsilon``: dp-accounting's ``calibrate_dp_mechanism`` (Brent's
    method, with a final check that ε <= target) over a bracket found by doubling up to
    ``max_noise_multiplier`` (default ``MAX_NOISE_MULTIPLIER``). With
    ``extra_releases_per_round``, z is every release's multiplier. 0 for rounds = 0.

    Raises ValueError when no z up to the bound reaches the target. Warns
    (``NoiseSearchWarning``) when the target is met only past a jump of the accountant's ε
    (``NoiseSearch.below_floor``); ``search_noise_multiplier`` returns the same search's
    result with how it ended, without warning."""
    result = search_noise_multiplier(
        target_epsilon, sampling_probability, rounds, delta, accountant=accountant,
        sampling=sampling, population=population,
        extra_releases_per_round=extra_releases_per_round,
        pld_discretization=pld_discretization, tol=tol,
        max_noise_multiplier=max_noise_multiplier)
    if result.hit_upper_bound:
        raise ValueError(result.error)
    if result.warning is not None:
        warnings.warn(result.warning, NoiseSearchWarning, stacklevel=2)
    return result.noise_multiplier
