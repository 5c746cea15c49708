"""User-level DP-FedAvg (McMahan et al. 2018) on Synthetic(0.5, 0.5): each client's update
is clipped to norm S, Gaussian noise of z·S is added to the sum, and ε is accounted with
dp-accounting (RDP, Poisson sampling of q = C).

    python examples/dp_fedavg.py --rounds 100
"""
# quick: --rounds 3

import argparse

import jax
import optax

import fedax
from fedax.aggregators import dp_gaussian
from fedax.models import softmax_cross_entropy
from fedax.privacy import epsilon
from fedax.simulation.sources import PartitionSource

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=100)
parser.add_argument("--noise", type=float, default=1.0, help="noise multiplier z")
args = parser.parse_args()

num_clients, q, clip, delta = 200, 0.1, 0.5, 1e-5
train, test = fedax.data.synthetic(0.5, 0.5, num_clients=num_clients, seed=0)
model = fedax.get_model("logistic", input_dim=60, num_classes=10)


def loss(params, batch):
    return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)


# The denominator is the expected cohort m = qN (fixed: it must not depend on the data).
aggregator = dp_gaussian(clip, args.noise, denominator=q * num_clients)
algorithm = fedax.fedavg(loss, optax.sgd(0.1), aggregator=aggregator)
source = PartitionSource(train, q, 1, 10, seed=0, sampling="poisson")
history = fedax.run(algorithm, model.init(jax.random.key(0)), source,
                    fedax.simulation.make_evaluator(model.apply, test.x, test.y),
                    rounds=args.rounds, eval_every=max(1, args.rounds // 5))
eps = epsilon(args.noise, q, args.rounds, delta)
print(f"z = {args.noise}: test accuracy {history.records[-1]['test_accuracy']:.3f}, "
      f"clipped clients last round {history.records[-1]['clipped_clients']:.0f}, "
      f"(ε, δ) = ({eps:.2f}, {delta:g}) after {args.rounds} rounds")
