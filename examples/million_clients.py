"""FedAvg over a population of a million virtual clients: each client's data is a pure
function of (seed, id), generated only when it is sampled, so nothing of size N is ever
materialized; a round costs O(cohort), not O(N).

    python examples/million_clients.py --rounds 50
"""
# quick: --rounds 2 --cohort 50

import argparse

import jax
import numpy as np
import optax

import fedax
from fedax.data import VirtualPopulation
from fedax.models import softmax_cross_entropy
from fedax.simulation import make_client_evaluator, run_population
from fedax.simulation.evaluation import client_index

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=50)
parser.add_argument("--cohort", type=int, default=1000)
args = parser.parse_args()

population = VirtualPopulation(10**6, alpha=0.5, beta=0.5, seed=0)
model = fedax.get_model("logistic", input_dim=60, num_classes=10)


def loss(params, batch):
    return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)


# Test on 500 clients drawn from the population, each on its own test split.
ids = np.random.default_rng(1).choice(10**6, 500, replace=False)
test = population.client_data(ids, "test")
owner = client_index([test.client_indices(j) for j in range(len(ids))], len(test.y))
evaluate = make_client_evaluator(model.apply, test.x, test.y, owner)

algorithm = fedax.fedavg(loss, optax.sgd(0.05))
history = run_population(algorithm, model.init(jax.random.key(0)), population, evaluate,
                         rounds=args.rounds, cohort_size=args.cohort, local_epochs=1,
                         batch_size=10, eval_every=max(1, args.rounds // 5))
for r in history.records:
    print(f"round {r['round']:3d}: accuracy {r['test_accuracy']:.3f} "
          f"(worst 10% of clients {r['client_accuracy_worst10']:.3f})")
