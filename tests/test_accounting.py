"""Privacy accounting (fedax.privacy): ε from Google's dp-accounting, its inverse, a run's
ledger, and the ``fedax privacy`` command."""

import ast
import math
import pathlib
import warnings

import dp_accounting
import numpy as np
import pytest
from conftest import run_fedax
from dp_accounting import pld, rdp

from fedax.cli.main import main
from fedax.privacy import (
    PrivacyLedger,
    accounting,
    adaptive_clip_noise_multipliers,
    describe,
    dp_event,
    effective_noise_multiplier,
    epsilon,
    noise_multiplier_for,
)

COARSE = 1e-3  # PLD value discretization where exactness is not asserted (fast)


def _direct(q, z, rounds, delta, kind="rdp", discretization=1e-4):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    acc = (rdp.RdpAccountant() if kind == "rdp"
           else pld.PLDAccountant(value_discretization_interval=discretization))
    acc.compose(event)
    return acc.get_epsilon(delta)


def test_the_module_imports_nothing_from_fedax_nor_jax():
    path = pathlib.Path(accounting.__file__)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert not {n for n in names if n.split(".")[0] in ("fedax", "jax", "optax")}, names


@pytest.mark.parametrize("q,z,rounds,delta", [(0.01, 1.0, 1000, 1e-5), (0.1, 0.8, 37, 1e-6),
                                              (1.0, 5.0, 10, 1e-5), (0.003, 2.0, 5000, 1e-8)])
def test_rdp_equals_the_direct_dp_accounting_call(q, z, rounds, delta):
    assert epsilon(z, q, rounds, delta) == _direct(q, z, rounds, delta)
    assert dp_event(z, q, rounds) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)


def test_pld_equals_the_direct_dp_accounting_call():
    got = epsilon(1.2, 0.05, 60, 1e-5, accountant="pld", pld_discretization=COARSE)
    assert got == _direct(0.05, 1.2, 60, 1e-5, "pld", COARSE)


def test_the_worked_figures():
    """Worked examples computed with dp-accounting itself (google/differential-privacy
    ``python/dp_accounting``, release 0.6.0; docs/references.md, differential privacy):
    Poisson sampling, add-or-remove-one neighbours, one Gaussian per round.
    RDP ε(q=0.01, z=1, T=1000, δ=1e-5) = 2.1014 (optimal order 7.8), PLD 1.8282; RDP
    1.4454 (q=0.001, T=1000, δ=1e-9), 0.5861 (q=1e-4, T=2000, δ=1e-6), 0.9555 (q=0.01,
    T=1, δ=1e-5)."""
    assert epsilon(1.0, 0.01, 1000, 1e-5) == pytest.approx(2.1014, abs=1e-3)
    assert epsilon(1.0, 0.01, 1000, 1e-5, accountant="pld") == pytest.approx(1.8282, abs=2e-3)
    assert epsilon(1.0, 0.001, 1000, 1e-9) == pytest.approx(1.4454, abs=1e-3)
    assert epsilon(1.0, 1e-4, 2000, 1e-6) == pytest.approx(0.5861, abs=1e-3)
    assert epsilon(1.0, 0.01, 1, 1e-5) == pytest.approx(0.9555, abs=1e-3)


def test_no_noise_is_infinite_and_no_rounds_are_free():
    assert epsilon(0.0, 0.01, 10, 1e-5) == math.inf
    assert epsilon(0.0, 0.01, 10, 1e-5, accountant="pld") == math.inf
    assert epsilon(1.0, 0.01, 0, 1e-5) == 0.0
    assert epsilon(0.0, 0.01, 0, 1e-5) == 0.0
    assert noise_multiplier_for(1.0, 0.01, 0, 1e-5) == 0.0


@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_the_inverse_round_trips_rdp(target):
    z = noise_multiplier_for(target, 0.01, 1000, 1e-5)
    assert 0.99 * target <= epsilon(z, 0.01, 1000, 1e-5) <= target
    assert epsilon(z * 0.99, 0.01, 1000, 1e-5) > target


def test_the_inverse_round_trips_pld():
    kw = {"accountant": "pld", "pld_discretization": COARSE}
    z = noise_multiplier_for(1.0, 0.05, 50, 1e-5, **kw)
    assert 0.99 <= epsilon(z, 0.05, 50, 1e-5, **kw) <= 1.0


def test_the_inverse_with_extra_releases():
    # (Fixed-size sampling's inverse is the same search; its RDP costs ~0.7 s per z.)
    kw = {"extra_releases_per_round": 1}
    z = noise_multiplier_for(2.0, 0.01, 500, 1e-5, **kw)
    assert 1.98 <= epsilon(z, 0.01, 500, 1e-5, **kw) <= 2.0
    assert z == pytest.approx(2 ** 0.5 * noise_multiplier_for(2.0, 0.01, 500, 1e-5), rel=1e-4)


def test_more_rounds_cost_more_and_more_noise_less():
    by_rounds = [epsilon(1.0, 0.02, t, 1e-5) for t in (1, 10, 100, 1000)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == 4
    by_noise = [epsilon(z, 0.02, 100, 1e-5) for z in (0.6, 0.8, 1.0, 2.0, 4.0)]
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == 5
    by_rounds = [epsilon(1.0, 0.02, t, 1e-5, accountant="pld", pld_discretization=COARSE)
                 for t in (1, 10, 100)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == 3


def test_pld_is_tighter_than_rdp():
    assert (epsilon(1.0, 0.01, 1000, 1e-5, accountant="pld", pld_discretization=COARSE)
            < epsilon(1.0, 0.01, 1000, 1e-5))


def test_adaptive_clipping_pair_is_the_single_gaussian():
    """Andrew et al.: the clipped sum at z_Δ and the unclipped count (sensitivity 0.5, noise
    σ_b, so multiplier 2σ_b) compose to one Gaussian with the total multiplier z."""
    z, sigma_b = 1.0, 0.05 * 100  # TFF's default σ_b = m/20, m = 100 clients per round
    pair = adaptive_clip_noise_multipliers(z, sigma_b)
    assert pair[1] == 2 * sigma_b and pair[0] > z
    assert effective_noise_multiplier(pair) == pytest.approx(z, rel=1e-12)
    assert epsilon(pair, 0.01, 1000, 1e-5) == pytest.approx(epsilon(z, 0.01, 1000, 1e-5),
                                                            rel=1e-9)
    kw = {"accountant": "pld", "pld_discretization": COARSE}
    assert epsilon(pair, 0.01, 200, 1e-5, **kw) == pytest.approx(
        epsilon(z, 0.01, 200, 1e-5, **kw), rel=1e-6)
    kw = {"sampling": "fixed", "population": 10_000}
    assert epsilon(pair, 0.01, 100, 1e-5, **kw) == pytest.approx(
        epsilon(z, 0.01, 100, 1e-5, **kw), rel=1e-9)
    # The event itself is the pair, composed inside one sampling per round.
    inner = dp_event(pair, 0.01, 3).event.event
    assert inner == dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(pair[0]), dp_accounting.GaussianDpEvent(pair[1])])
    with pytest.raises(ValueError, match="2 \\* clipped_count_stddev"):
        adaptive_clip_noise_multipliers(1.0, 0.5)


def test_extra_releases_compose_within_the_round():
    one = epsilon(1.0, 0.01, 300, 1e-5)
    two = epsilon(1.0, 0.01, 300, 1e-5, extra_releases_per_round=1)
    assert two > one
    assert two == pytest.approx(epsilon(2 ** -0.5, 0.01, 300, 1e-5), rel=1e-9)
    pld_two = epsilon(1.0, 0.01, 300, 1e-5, accountant="pld", pld_discretization=COARSE,
                      extra_releases_per_round=1)
    assert pld_two == epsilon(2 ** -0.5, 0.01, 300, 1e-5, accountant="pld",
                              pld_discretization=COARSE)
    assert len(dp_event(1.0, 0.01, 3, extra_releases_per_round=2).event.event.events) == 3


def test_fixed_size_sampling_is_rdp_replace_one_with_half_the_multiplier():
    """m of N without replacement: dp-accounting's RDP accountant under REPLACE_ONE; a
    replaced client moves a clipped sum by up to 2C, so the Gaussian carries z/2."""
    got = epsilon(1.0, 0.01, 500, 1e-5, sampling="fixed", population=10_000)
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        10_000, 100, dp_accounting.GaussianDpEvent(0.5)), 500))
    assert got == acc.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="PLD"):
        epsilon(1.0, 0.01, 5, 1e-5, sampling="fixed", population=10_000, accountant="pld")
    with pytest.raises(ValueError, match="population"):
        epsilon(1.0, 0.01, 5, 1e-5, sampling="fixed")
    with pytest.raises(ValueError, match="whole number of clients"):
        epsilon(1.0, 0.015, 5, 1e-5, sampling="fixed", population=100)


def test_ledger():
    ledger = PrivacyLedger(1.0, 0.01, 1e-5)
    assert ledger.epsilon_after(1000) == epsilon(1.0, 0.01, 1000, 1e-5)
    assert ledger.epsilon_after(0) == 0.0
    assert 1000 in ledger._cache
    t = ledger.rounds_within(2.0)
    assert ledger.epsilon_after(t) <= 2.0 < ledger.epsilon_after(t + 1)
    assert ledger.rounds_within(2.0, max_rounds=100) == 100
    assert ledger.rounds_within(ledger.epsilon_after(1) / 2) == 0
    assert ledger.rounds_within(ledger.epsilon_after(1)) == 1
    assert PrivacyLedger(0.0, 0.01, 1e-5).rounds_within(100.0) == 0
    fixed = PrivacyLedger(2.0, 0.1, 1e-5, "rdp", sampling="fixed", population=50)
    t = fixed.rounds_within(3.0)
    assert fixed.epsilon_after(t) <= 3.0 < fixed.epsilon_after(t + 1)
    assert "fixed-size sampling, m = 5 of N = 50" in fixed.describe()


def test_describe_names_the_accountant_and_sampling():
    text = describe(1.0, 0.01, accountant="pld")
    assert "PLD accountant (dp-accounting 0.6" in text and "Poisson" in text
    assert "ADD_OR_REMOVE_ONE" in text
    text = describe(1.0, 0.01, sampling="fixed", population=1000, extra_releases_per_round=1)
    assert "REPLACE_ONE" in text and "2 Gaussian releases per round" in text


@pytest.mark.parametrize("kwargs,match", [
    ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite number >= 0"),
    ({"noise_multiplier": math.nan}, "noise_multiplier"),
    ({"noise_multiplier": ()}, "non-empty"),
    ({"sampling_probability": 0.0}, "sampling_probability must be in \\(0, 1\\]"),
    ({"sampling_probability": 1.5}, "sampling_probability"),
    ({"delta": 0.0}, "delta must be in \\(0, 1\\)"),
    ({"delta": 1.0}, "delta"),
    ({"rounds": -1}, "rounds must be a whole number >= 0"),
    ({"rounds": 2.5}, "rounds"),
    ({"accountant": "moments"}, "accountant must be one of rdp, pld"),
    ({"sampling": "shuffle"}, "sampling must be one of poisson, fixed"),
    ({"extra_releases_per_round": -1}, "extra_releases_per_round"),
    ({"population": 0}, "population"),
])
def test_bad_arguments_are_clear_value_errors(kwargs, match):
    args = {"noise_multiplier": 1.0, "sampling_probability": 0.01, "rounds": 10,
            "delta": 1e-5} | kwargs
    with pytest.raises(ValueError, match=match):
        epsilon(**args)


def test_inverse_and_ledger_validate_too():
    with pytest.raises(ValueError, match="target_epsilon"):
        noise_multiplier_for(0.0, 0.01, 10, 1e-5)
    with pytest.raises(ValueError, match="sampling_probability"):
        noise_multiplier_for(1.0, 0.0, 10, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(1.0, 0.01, 2.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyLedger(1.0, 0.01, 1e-5).rounds_within(-1.0)


def test_delta_not_below_one_over_n_warns():
    with pytest.warns(UserWarning, match="not below 1/N = 0.001 for a population of N = 1000"):
        epsilon(1.0, 0.01, 10, 1e-3, population=1000)
    with pytest.warns(UserWarning, match="1/N"):
        PrivacyLedger(1.0, 0.01, 0.5, population=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        epsilon(1.0, 0.01, 10, 1e-6, population=1000)


# ------------------------------------------------------------------------------ the command


def test_command_prints_epsilon_and_what_it_assumes(tmp_path):
    done = run_fedax("privacy", "epsilon", "--q", "0.01", "--z", "1.0", "--rounds", "1000",
                     "--delta", "1e-5", "--sampling", "poisson", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    first, sampling, second = done.stdout.strip().splitlines()
    assert first == "epsilon = 2.10137 at delta = 1e-05 after 1000 rounds"
    assert sampling.startswith("sampling: Poisson")
    assert second.startswith("assumes: RDP accountant") and "Poisson sampling" in second


def test_command_a_bad_flag_is_one_line(tmp_path):
    done = run_fedax("privacy", "epsilon", "--q", "2", "--z", "1.0", "--rounds", "10",
                     "--delta", "1e-5", "--sampling", "poisson", cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == ("fedax: error: --q must be in (0, 1] (the fraction of "
                                   "clients sampled per round), got 2.0")


def test_command_in_process(capsys):
    assert main(["privacy", "epsilon", "--q", "0.01", "--z", "1", "--rounds", "1000",
                 "--delta", "1e-5", "--accountant", "pld", "--sampling", "poisson"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert float(first.split()[2]) == pytest.approx(1.8282, abs=2e-3)
    assert main(["privacy", "noise", "--q", "0.01", "--epsilon", "2", "--rounds", "1000",
                 "--delta", "1e-5", "--sampling", "poisson"]) == 0
    out = capsys.readouterr().out
    z = float(out.split()[4])
    assert z >= noise_multiplier_for(2.0, 0.01, 1000, 1e-5)
    assert epsilon(z, 0.01, 1000, 1e-5) <= 2.0
    assert out.splitlines()[2].startswith("assumes: RDP accountant")
    bad = [["privacy", "epsilon", "--q", "0.01", "--z", "x", "--rounds", "1", "--delta", "0.1"],
           ["privacy", "noise", "--q", "0.01", "--rounds", "1", "--delta", "1e-5"],
           ["privacy", "epsilon", "--q", "0.01", "--z", "1", "--rounds", "1", "--delta", "1e-5",
            "--sampling", "fixed", "--population", "100", "--accountant", "pld"]]
    for argv in bad:
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
        assert status == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fedax: error: "), err


def test_round_up_never_understates_and_keeps_the_digits():
    from fedax.privacy import round_up

    rng = np.random.default_rng(0)
    for value in np.exp(rng.uniform(-12, 12, size=500)):
        for digits in (4, 6):
            shown = float(round_up(float(value), digits))
            assert shown >= value and shown - value <= value * 10.0 ** (1 - digits)
    assert round_up(2.7656281906378397, 4) == "2.766" and round_up(3.0, 4) == "3"
    assert round_up(0.0) == "0" and round_up(float("inf")) == "inf"
