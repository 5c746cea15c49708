"""The Flower ClientApp of bench_flower.py: the same PyTorch client as bench_torch.py.

A module of its own (not ``__main__``) so that Ray's worker processes import it by name:
Flower's Ray backend passes the driver's ``sys.path`` to its workers as PYTHONPATH.

Virtual client ``partition-id`` k holds W's k-th IID shard (``fedax.data.iid``, as everywhere
in these benchmarks). In round t it takes E·⌈n_k/B⌉ = 300 SGD steps over its examples,
reshuffled each epoch by ``np.random.default_rng([SEED, t, k])`` (Flower samples the
clients, so the shuffles are drawn per client rather than per cohort as in fedax's runner;
the work is the same). Each Ray worker process loads MNIST and builds the model once, on
its first message, and keeps them; ``FEDAX_BENCH_CLIENT_THREADS`` sets torch's intra-op
threads (the CPUs each client is given).
"""

from __future__ import annotations

import os

import common
import numpy as np
import torch
import torch_common as tc
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

THREADS_ENV = "FEDAX_BENCH_CLIENT_THREADS"
MODEL_ENV = "FEDAX_BENCH_MODEL"

_CACHE: dict[str, object] = {}


def _setup():
    if not _CACHE:
        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        train, x_np, y_np = common.load_federated_mnist()
        x, y = tc.to_tensors(x_np, y_np)
        _CACHE.update(train=train, x=x, y=y, net=tc.build_model(os.environ[MODEL_ENV]))
    return _CACHE


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fedax.data import make_cohort

    cache = _setup()
    k = int(context.node_config["partition-id"])
    server_round = int(msg.content["config"]["server-round"])
    lr = float(msg.content["config"]["lr"])
    rng = np.random.default_rng([common.SEED, server_round, k])
    cohort = make_cohort(cache["train"], [k], common.LOCAL_EPOCHS, common.BATCH_SIZE, rng,
                         num_steps=common.STEPS_PER_CLIENT)
    batches = common.client_batches(cohort.idx[0], cohort.mask[0])
    global_state = msg.content["arrays"].to_torch_state_dict()
    state, loss = tc.train_client(cache["net"], global_state, cache["x"], cache["y"], batches,
                                  lr)
    content = RecordDict({
        "arrays": ArrayRecord(state),
        "metrics": MetricRecord({"train_loss": loss,
                                 "num-examples": int(cohort.num_examples[0])}),
    })
    return Message(content=content, reply_to=msg)
