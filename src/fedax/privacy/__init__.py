"""Differential privacy accounting: the ε of a DP-FedAvg run, from Google's dp-accounting.

    eps = epsilon(noise_multiplier=1.0, sampling_probability=0.01, rounds=1000, delta=1e-5)
    z = noise_multiplier_for(2.0, sampling_probability=0.01, rounds=1000, delta=1e-5)
    ledger = PrivacyLedger(1.0, 0.01, 1e-5)
    ledger.epsilon_after(500), ledger.rounds_within(2.0)

No accountant is written here: ``accounting`` builds the dp-accounting event of the rounds
(the subsampled Gaussian mechanism, user-level) and asks dp-accounting's RDP or PLD
accountant for ε; ``ledger`` keeps a run's ε round by round, ``calibration`` finds z for a
target ε. Nothing here imports JAX or the rest of fedax.
"""

from fedax.privacy.accounting import (
    ACCOUNTANTS,
    SAMPLINGS,
    adaptive_clip_noise_multipliers,
    describe,
    dp_event,
    effective_noise_multiplier,
    epsilon,
    round_up,
)
from fedax.privacy.calibration import (
    MAX_NOISE_MULTIPLIER,
    NoiseSearch,
    NoiseSearchWarning,
    noise_multiplier_for,
    search_noise_multiplier,
)
from fedax.privacy.distributed import distributed_epsilon  # noqa: E402
from fedax.privacy.ledger import ExampleLevelLedger, PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "MAX_NOISE_MULTIPLIER",
    "SAMPLINGS",
    "ExampleLevelLedger",
    "NoiseSearch",
    "NoiseSearchWarning",
    "PrivacyLedger",
    "adaptive_clip_noise_multipliers",
    "describe",
    "distributed_epsilon",
    "dp_event",
    "effective_noise_multiplier",
    "epsilon",
    "noise_multiplier_for",
    "round_up",
    "search_noise_multiplier",
]
