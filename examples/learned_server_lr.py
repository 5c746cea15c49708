"""Learn FedAvg's server learning rate η by hypergradient descent (federated AD): each
round, the derivative of a holdout loss after the round with respect to log η, through the
whole round in forward mode, drives Adam on log η.

    python examples/learned_server_lr.py --rounds 40
"""
# quick: --rounds 3

import argparse

from fedax.experiments.outputs import read_records
from fedax.experiments.run import run_experiment
from fedax.spec.config import validate_config

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=40)
parser.add_argument("--out", default="runs/examples/learned_server_lr")
args = parser.parse_args()

config = validate_config({
    "rounds": args.rounds, "dataset": "synthetic", "num_clients": 30, "model": "logistic",
    "algorithm": "fedavg", "client_fraction": 0.2, "local_epochs": 1, "batch_size": 10,
    "client_lr": 0.05, "execution": {"devices": 1},
    # η starts at 0.3 and is learned: Adam at 0.05 on log η, 6 holdout clients a round
    "server": {"lr": "learned"},
    "learned_lr": {"init": 0.3, "hyper_lr": 0.05, "holdout_clients": 6, "mode": "forward"},
})
summary = run_experiment(config, args.out, progress=False)
for record in read_records(f"{args.out}/metrics.jsonl"):
    print(f"round {record['round']:3d}: η = {record['server_lr']:.3f}, "
          f"test accuracy {record['test_accuracy']:.3f}")
print(f"final accuracy {summary['final_test_accuracy']:.3f}; outputs in {args.out}/")
