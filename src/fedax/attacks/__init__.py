"""Simulated attacks on federated learning: misbehaving clients, chosen by seed.

A layer beside ``algorithms``/``aggregators``: it imports data, federated, aggregators and
algorithms, never simulation or experiments. Two kinds (docs/references.md, robust
aggregation and attacks):

* data-level (``data``): the attackers train honestly on corrupted data: label flipping,
  the MNIST backdoor trigger (and the inputs that measure its success rate);
* update-level (``updates``): the attackers replace their update before the server sees
  it: sign flipping, scaled/boosted updates, Gaussian noise, ALIE, IPM. ``attacked(alg,
  adversary)`` gives the attacked algorithm.

    bad = choose_attackers(num_clients=100, fraction=0.2, seed=0)
    alg = attacked(fedavg(loss, optax.sgd(0.1), aggregator=median()),
                   alie(bad, num_clients=100))
"""

from fedax.attacks.data import add_trigger, backdoor_test_set, flip_labels, poison_backdoor
from fedax.attacks.selection import attacker_table, choose_attackers
from fedax.attacks.updates import (
    UPDATE_ATTACKS,
    Adversary,
    alie,
    alie_z,
    gaussian,
    ipm,
    scaled,
    sign_flip,
)
from fedax.attacks.wrap import attacked

DATA_ATTACKS = ("label_flip", "backdoor")
"""The data-level attacks (``flip_labels``, ``poison_backdoor``)."""

__all__ = ["DATA_ATTACKS", "UPDATE_ATTACKS", "Adversary", "add_trigger", "alie", "alie_z",
           "attacked", "attacker_table", "backdoor_test_set", "choose_attackers",
           "flip_labels", "gaussian", "ipm", "poison_backdoor", "scaled", "sign_flip"]
