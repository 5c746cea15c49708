"""FedAvg on non-IID MNIST (McMahan et al. 2017): the 2NN, 100 clients of two label shards
each, C = 0.1, E = 1, B = 10. Evaluated globally and on each client's own test data, and
logged to TensorBoard.

    python examples/fedavg_mnist.py --rounds 100
    tensorboard --logdir runs/examples     # optional: pip install tensorboard
"""
# quick: --rounds 2

import argparse

import jax
import optax

import fedax
from fedax import data as fdata
from fedax.models import softmax_cross_entropy
from fedax.simulation.evaluation import client_index, make_client_evaluator
from fedax.simulation.tensorboard import TensorBoardLogger

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=100)
parser.add_argument("--out", default="runs/examples/fedavg_mnist")
args = parser.parse_args()

mnist = fdata.load_mnist()  # fetched and checked into ~/.cache/fedax on first use
x, y, x_test, y_test = mnist["x_train"], mnist["y_train"], mnist["x_test"], mnist["y_test"]
train = fdata.ClientData.from_partition(x, y, fdata.pathological(y, 100, 2, seed=0))
# Each client's own test data: the test set dealt by the same partitioner.
test_clients = client_index(fdata.pathological(y_test, 100, 2, seed=0), len(y_test))

model = fedax.get_model("2nn")  # 199,210 parameters


def loss(params, batch):  # the masked mean loss of one batch
    return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)


algorithm = fedax.fedavg(loss, client_optimizer=optax.sgd(0.1))  # server: SGD, lr 1
evaluate = make_client_evaluator(model.apply, x_test, y_test, test_clients, target=0.97)
with TensorBoardLogger(f"{args.out}/tensorboard") as board:
    history = fedax.run(algorithm, model.init(jax.random.key(0)), train, evaluate,
                        rounds=args.rounds, client_fraction=0.1, local_epochs=1,
                        batch_size=10, seed=0, eval_every=max(1, args.rounds // 20),
                        callbacks=[board], round_callbacks=[board.on_round])
for r in history.records:
    print(f"round {r['round']:4d}  global {r['test_accuracy']:.3f}  "
          f"median client {r['client_accuracy_p50']:.3f}  "
          f"worst 10% {r['client_accuracy_worst10']:.3f}")
print("rounds to 97%:", history.rounds_to_target(0.97))
