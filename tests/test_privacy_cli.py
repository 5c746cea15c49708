"""`fedax privacy epsilon|noise`: they assume what a run assumes (fixed-size sampling, the
population N, replace-one neighbours) and say so on a line of their own; their ε is a run's
ε, recomputed here with dp-accounting directly; and the search for z says when it hit its
upper bound of z or the accountant's floor, with exit status 0 only for a z that meets the
target."""

import warnings

import dp_accounting
import numpy as np
import pytest
import yaml
from conftest import TINY_CONFIG

import fedax.privacy
from fedax.cli.main import main
from fedax.privacy import accounting
from fedax.privacy.calibration import (
    MAX_NOISE_MULTIPLIER,
    NoiseSearchWarning,
    noise_multiplier_for,
    search_noise_multiplier,
)

Q, Z, T, DELTA, N = 0.25, 1.0, 4, 1e-5, 100  # q*N = 25 clients a round
EPSILON = ["privacy", "epsilon", "--q", "0.25", "--z", "1", "--rounds", "4", "--delta", "1e-5"]


def run(argv, capsys) -> tuple[int, list[str], list[str]]:
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def direct_epsilon(z: float, population: int, m: int, rounds: int, delta: float) -> float:
    """accounting.py's fixed-size event written out: m of N without replacement, the
    Gaussian at z/2 (replace-one moves a clipped sum by 2C), T rounds, RDP, REPLACE_ONE."""
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        population, m, dp_accounting.GaussianDpEvent(z / 2)), rounds)
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    return accountant.compose(event).get_epsilon(delta)


def printed_epsilon(line: str) -> float:
    assert line.startswith("epsilon = "), line
    return float(line.split()[2])


def test_epsilon_defaults_to_a_runs_fixed_sampling_and_equals_its_ledger(capsys):
    from fedax.builder.privacy_plan import privacy_plan
    from fedax.spec.config import validate_config

    status, out, err = run([*EPSILON, "--population", str(N)], capsys)
    assert status == 0 and err == []
    eps, sampling, assumes = out
    assert sampling == ("sampling: fixed-size (m = 25 of N = 100 without replacement), "
                        "neighbours: replace-one client")
    assert assumes.startswith("assumes: RDP accountant") and "REPLACE_ONE" in assumes
    # a run with the privacy section's defaults (sampling fixed), the same numbers
    data = yaml.safe_load(TINY_CONFIG)
    data.update(num_clients=N, client_fraction=Q, rounds=T,
                privacy={"mechanism": "gaussian", "clip": 1.0, "noise_multiplier": Z,
                         "delta": DELTA})
    config = validate_config(data)
    assert config.privacy.sampling == "fixed"
    plan = privacy_plan(config, N)
    assert (plan.ledger.sampling, plan.ledger.population) == ("fixed", N)
    ours = plan.ledger.epsilon_after(T)
    assert ours == pytest.approx(direct_epsilon(Z, N, 25, T, DELTA), rel=1e-12)
    assert ours == pytest.approx(18.3559, abs=1e-4)  # not Poisson's 4.87
    # printed rounded up to 6 significant digits: never below the run's ε, and within it
    assert ours <= printed_epsilon(eps) <= ours * (1 + 1e-5)
    assert eps.endswith("at delta = 1e-05 after 4 rounds")


def test_a_fraction_whose_cohort_is_not_whole_is_drawn_as_a_run_draws_it(capsys):
    """q = 0.3 of N = 7: a run samples m = floor(2.1) = 2 clients, so q is 2/7."""
    status, out, _ = run([*EPSILON[:2], "--q", "0.3", *EPSILON[4:], "--population", "7"],
                         capsys)
    assert status == 0
    assert out[1].startswith("sampling: fixed-size (m = 2 of N = 7 without replacement; "
                             "q*N = 2.1 is not whole: m = 2")
    assert printed_epsilon(out[0]) >= direct_epsilon(Z, 7, 2, T, DELTA)
    assert printed_epsilon(out[0]) == pytest.approx(direct_epsilon(Z, 7, 2, T, DELTA),
                                                    rel=1e-5)


def test_poisson_says_so_and_its_neighbours(capsys):
    status, out, _ = run([*EPSILON, "--sampling", "poisson"], capsys)
    assert status == 0
    assert out[1] == ("sampling: Poisson (each client with probability q = 0.25 per round), "
                      "neighbours: add-or-remove-one client")
    assert printed_epsilon(out[0]) == pytest.approx(4.87095, abs=1e-5)
    status, out, _ = run([*EPSILON, "--sampling", "poisson", "--population", "1000"], capsys)
    assert status == 0 and "per round of N = 1000)" in out[1]


@pytest.mark.parametrize("command", [
    EPSILON,
    ["privacy", "noise", "--q", "0.25", "--epsilon", "2", "--rounds", "4", "--delta", "1e-5"],
    [*EPSILON, "--sampling", "fixed"],
])
def test_fixed_sampling_without_a_population_is_a_usage_error_naming_both_fixes(command,
                                                                               capsys):
    status, out, err = run(command, capsys)
    assert status == 2 and out == []
    assert len(err) == 1 and err[0].startswith("fedax: error: fixed-size sampling"), err
    assert "--population N" in err[0] and "--sampling poisson" in err[0]


def test_pld_with_the_default_sampling_names_both_fixes(capsys):
    status, out, err = run([*EPSILON, "--population", "100", "--accountant", "pld"], capsys)
    assert status == 2 and out == [] and len(err) == 1
    assert "--accountant rdp" in err[0] and "--sampling poisson" in err[0]


def test_noise_defaults_to_fixed_sampling_and_its_z_meets_the_target(capsys):
    status, out, err = run(["privacy", "noise", "--q", "0.25", "--epsilon", "2", "--rounds",
                            "4", "--delta", "1e-5", "--population", "100"], capsys)
    assert status == 0 and err == []
    z = float(out[0].split()[4])
    assert out[1].startswith("sampling: fixed-size (m = 25 of N = 100")
    assert direct_epsilon(z, N, 25, T, DELTA) <= 2.0
    assert z == pytest.approx(noise_multiplier_for(2.0, Q, T, DELTA, sampling="fixed",
                                                   population=N), rel=1e-5)


# ------------------------------------------------------------------------------ the search


def test_the_search_reports_the_accountants_floor_and_the_command_warns(capsys):
    """RDP's ε stops falling near 0.0035 at q = 0.25, T = 4, δ = 1e-5 (its largest order,
    1024, and δ set the floor), then drops to 0 at z ≈ 5e4: ε = 0.001 is met only there."""
    found = search_noise_multiplier(0.001, Q, T, DELTA)
    assert found.reached and not found.hit_upper_bound
    assert found.epsilon == 0.0 and found.noise_multiplier > 1e4
    z_below, eps_below = found.below_floor
    assert z_below < found.noise_multiplier and eps_below > 0.001
    with pytest.warns(NoiseSearchWarning, match="hit the accountant's floor"):
        assert noise_multiplier_for(0.001, Q, T, DELTA) == found.noise_multiplier
    status, out, err = run(["privacy", "noise", "--q", "0.25", "--epsilon", "0.001",
                            "--rounds", "4", "--delta", "1e-5", "--sampling", "poisson"],
                           capsys)
    assert status == 0  # the printed z does meet the target, by this accountant
    assert len(err) == 1 and err[0].startswith("fedax: warning: the search for the noise "
                                               "multiplier hit the accountant's floor")
    assert "the epsilon target may be out of reach at q = 0.25, T = 4, delta = 1e-05" in err[0]
    z = float(out[0].split()[4])
    assert fedax.privacy.epsilon(z, Q, T, DELTA) <= 0.001


def test_the_search_reports_its_upper_bound_and_the_command_fails(capsys):
    """At δ = 1e-7 RDP's floor (0.008) holds up to the search's bound of z: no z reaches
    ε = 0.001. The library raises as before; the command warns and exits 1."""
    found = search_noise_multiplier(0.001, Q, T, 1e-7)
    assert found.hit_upper_bound and not found.reached
    assert found.noise_multiplier == found.upper_bound == MAX_NOISE_MULTIPLIER
    assert found.epsilon > 0.001 and "hit its upper bound of z = 1.04858e+06" in found.warning
    with pytest.raises(ValueError, match="no noise multiplier up to 1.04858e"):
        noise_multiplier_for(0.001, Q, T, 1e-7)
    status, out, err = run(["privacy", "noise", "--q", "0.25", "--epsilon", "0.001",
                            "--rounds", "4", "--delta", "1e-7", "--sampling", "poisson"],
                           capsys)
    assert status == 1 and out == []
    warning, error = err
    assert warning.startswith("fedax: warning: the search for the noise multiplier hit its "
                              "upper bound of z = 1.04858e+06")
    assert "the epsilon target may be unreachable at q = 0.25, T = 4, delta = 1e-07" in warning
    assert error.startswith("fedax: error: no noise multiplier up to 1.04858e+06 reaches "
                            "epsilon 0.001")


def test_a_smaller_bound_is_hit_sooner():
    found = search_noise_multiplier(0.5, Q, T, DELTA, max_noise_multiplier=4)
    assert found.hit_upper_bound and found.noise_multiplier == 4.0
    assert found.epsilon == pytest.approx(fedax.privacy.epsilon(4.0, Q, T, DELTA))


def test_a_normal_search_is_unchanged_and_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = noise_multiplier_for(2.0, 0.01, 1000, 1e-5)
    found = search_noise_multiplier(2.0, 0.01, 1000, 1e-5)
    assert found.noise_multiplier == z and found.warning is None and found.reached
    assert found.below_floor is None and not found.hit_upper_bound
    assert 2.0 - 1e-4 < found.epsilon <= 2.0
    assert search_noise_multiplier(2.0, 0.01, 0, 1e-5).noise_multiplier == 0.0


def test_a_printed_z_that_misses_the_target_exits_1(capsys, monkeypatch):
    """Should rounding z up ever give an ε above the target, the command says so and fails
    instead of printing it."""
    monkeypatch.setattr(fedax.privacy, "epsilon", lambda *args, **kwargs: 3.0)
    status, out, err = run(["privacy", "noise", "--q", "0.25", "--epsilon", "2", "--rounds",
                            "4", "--delta", "1e-5", "--sampling", "poisson"], capsys)
    assert status == 1 and out == []
    assert len(err) == 1 and err[0].startswith("fedax: error: the noise multiplier found")
    assert "epsilon 3 > 2" in err[0]


def test_negative_rdp_from_rounding_is_no_guarantee():
    """dp-accounting turns a negative RDP value (rounding at extreme noise) into ε = 0;
    those orders are left out instead, so ε stays a bound that was computed."""
    orders, values = accounting._rdp_of_one_round((1e8,), 0.25, "poisson", None, 0)
    assert (values >= 0).all()
    assert np.isinf(values).any()  # the orders that rounded below 0
