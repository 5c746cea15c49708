"""Communication per round of FedAvg and of its server-learning-rate hypergradient step,
in each accumulation mode, read off the traced programs with ``fedax.federated.comm_cost``.

Usage: python experiments/fad_comm_table.py [--clients 10] [--model 2nn]
Prints a markdown table (bytes per round, down = server -> clients, up = clients -> server).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedavg
from fedax.client import Batches
from fedax.hyper import HyperCohort, learned_server_lr
from fedax.models import get_model, param_count, softmax_cross_entropy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--model", default="2nn")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    model = get_model(args.model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)

    def loss_fn(p, batch):
        return softmax_cross_entropy(model.apply(p, batch.x), batch.y, batch.mask)

    c, s, b = args.clients, args.steps, 10
    batches = Batches(np.zeros((c, s, b, 28, 28, 1), np.float32), np.zeros((c, s, b), np.int32),
                      np.ones((c, s, b), np.float32))
    cohort = CohortBatches(batches, np.full(c, 600.0, np.float32), np.arange(c, dtype=np.int32))
    make = lambda lr: fedavg(loss_fn, optax.sgd(0.1), optax.sgd(lr))

    rows = [("FedAvg round", fed.comm_cost(make(1.0).round, make(1.0).init(params, None),
                                           cohort, None))]
    for mode in ("forward", "reverse"):
        alg = learned_server_lr(make, 1.0, loss_fn, mode=mode)
        state = alg.init(params, None)
        cost = fed.comm_cost(alg.round, state, HyperCohort(cohort, cohort), None)
        rows.append((f"round + server-lr hypergradient, {mode} mode", cost))

    model_bytes = param_count(params) * 4
    print(f"{args.model}: {param_count(params):,} parameters ({model_bytes:,} B), "
          f"{c} training clients and {c} holdout clients per round\n")
    print("| program | down (B) | up (B) | down / model / client | up / model / client |")
    print("|---|---|---|---|---|")
    for name, cost in rows:
        d, u = cost.server_to_clients_bytes, cost.clients_to_server_bytes
        print(f"| {name} | {d:,} | {u:,} | {d / model_bytes / c:.2f} | {u / model_bytes / c:.2f} |")


if __name__ == "__main__":
    main()
