"""Apple's pfl-research (``pfl``, PyTorch backend) on workload W, with the PyTorch models of
bench_torch.py.

    python benchmarks/bench_pfl.py 2nn --procs 1 --rounds 5 --warmup 1
    python benchmarks/bench_pfl.py 2nn --procs 2 --rounds 2 --check   # + test loss/accuracy

Set up as pfl's own benchmarks (``benchmarks/image_classification/pytorch/train.py`` in
apple/pfl-research) run a simulation: the whole dataset in memory as torch tensors, one
``pfl.data.dataset.Dataset`` slice per user through ``FederatedDataset.from_slices`` (pfl's
docs: the fastest form when the data fits in RAM), a ``PyTorchModel`` with
``torch.optim.SGD`` as the local optimizer and a central ``SGD(lr=1.0)`` (pfl applies the
averaged model difference as a gradient step, so lr 1 makes the new model the weighted mean
of the client models), ``FederatedAveraging`` with ``NNAlgorithmParams``/
``NNTrainHyperParams(local_learning_rate=0.05, local_num_epochs=5, local_batch_size=10)``
and a ``SimulatedBackend`` whose ``WeightByDatapoints`` postprocessor makes the mean
n_k-weighted.

Fairness against the PyTorch and Flower rows:
- The model and its initial weights are ``torch_common.build_model`` (Glorot-uniform
  kernels, zero biases, ``torch.manual_seed(0)``: the PyTorch row's initial model), wrapped in
  a module adding the ``loss``/``metrics`` methods pfl requires; the loss is the same mean
  cross-entropy per batch of B = 10, and pfl's SGD bridge takes one ``SGD`` step per batch
  (no gradient clipping, no accumulation, no mixed precision, no ``torch.compile``: pfl's
  defaults).
- Data: W's partition (``fedax.data.iid(60000, 100, 0)``), and each round's 10 clients are
  the ones fedax's runner and the PyTorch row train (the user sampler yields
  ``fedax.data.sample_clients`` of ``default_rng([0, t])``, the first draw of
  ``common.round_cohort``). The examples' order is pfl's own: ``Dataset.iter`` walks the
  user's 600 examples in the same order every epoch, where fedax reshuffles each epoch; the
  work (300 steps of 10 examples per client) is the same.
- No evaluation inside the rounds: no ``CentralEvaluationCallback``, ``val_cohort_size=0``,
  and the per-user evaluation that ``FederatedNNAlgorithm`` runs before and after local
  training on evaluation iterations (always iteration 0) is switched off, so a round is
  training and aggregation only. The training loss the record carries is accumulated during
  training (as bench_torch.py does) and reported as a pfl ``Weighted`` metric, which pfl
  all-reduces with the model update. Metrics are not printed to the console
  (``send_metrics_to_platform=False``). ``--check`` evaluates on the MNIST test set before
  and after the run, outside the timing.
- A round is timed as Flower's is, by the server loop: a pfl callback marks
  ``on_train_begin`` and each ``after_central_iteration`` (the new global model is in
  place), so a round covers pfl's cohort sampling, local training, aggregation (and the
  all-reduce between workers) and the model update.
- Threads as in the PyTorch row: ``--procs 1`` with ``--threads`` intra-op threads (default
  one per core), ``--procs 2`` with 1 thread per process; one inter-op thread.

``--procs 2`` is pfl's multi-process simulation on one CPU host (its distributed-simulation
guide: "Multi-process training"): two processes each run the same script; pfl's
``PyTorchDistributedContext`` joins them in a ``torch.distributed`` process group (gloo on
CPU), ``FederatedDataset.get_cohort`` gives each its share of the cohort (5 clients), and
``SimulatedBackend`` all-reduces the summed updates and metrics. The guide offers ``torchrun``
or the environment variables ``PFL_WORKER_ADDRESSES``/``PFL_WORKER_RANK`` to launch the
processes; this script uses the variables (the same process group and code path) so that
rank 0 is the benchmark process itself and rank 1 its child: the CPU time and memory
measured over rank 0's process tree cover both, with no launcher agent in between. No MPI or
Horovod is needed. pfl's ``user_id_to_weight`` (a sampling subprocess that balances users by
size between workers) is left out: all users hold 600 examples.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LOSS_METRIC = "train loss"


def launch_ranks(procs: int, argv_of_rank) -> list[subprocess.Popen]:
    """pfl's multi-process simulation: set this process up as rank 0 of ``procs`` (pfl reads
    ``PFL_WORKER_ADDRESSES``/``PFL_WORKER_RANK`` when its PyTorch ops are imported, so call
    this first) and start ranks 1.. as ``argv_of_rank(r)``; returns their processes."""
    os.environ["PFL_WORKER_ADDRESSES"] = ",".join(
        f"localhost:{_free_port()}" for _ in range(procs))
    os.environ["PFL_WORKER_RANK"] = "0"
    return [subprocess.Popen(argv_of_rank(r), env={**os.environ, "PFL_WORKER_RANK": str(r)})
            for r in range(1, procs)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    common.add_process_args(parser)
    parser.add_argument("--check", action="store_true",
                        help="smoke check: evaluate on the MNIST test set before and after "
                             "the run (outside the timing; with --procs 2 the other rank "
                             "starts meanwhile, so the first round is shorter)")
    parser.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    threads = common.threads_per_process(args)
    rank = args.worker_rank

    # pfl reads these when its PyTorch ops are imported (``pfl.model.pytorch``), so set them
    # (and start the other rank) first.
    peers = []
    if args.procs > 1 and rank == 0:
        peers = launch_ranks(args.procs, lambda r: [
            sys.executable, os.path.abspath(__file__), args.model,
            "--procs", str(args.procs), "--threads", str(threads),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--worker-rank", str(r)])

    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_common as tc
    from torch import nn

    from fedax.data import iid, load_mnist, sample_clients

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)

    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module as get_ops
    from pfl.metrics import Metrics, StringMetricName, Weighted
    from pfl.model.pytorch import PyTorchModel

    class PflModule(nn.Module):
        """The benchmark's model with the ``loss``/``metrics`` methods pfl calls. ``loss``
        also accumulates the training loss (detached), as bench_torch.py's loop does."""

        def __init__(self, net: nn.Module):
            super().__init__()
            self.net = net
            self.loss_sum = torch.zeros(())
            self.steps = 0

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y):
            value = F.cross_entropy(self.net(x), y)
            self.loss_sum += value.detach()
            self.steps += 1
            return value

        @torch.no_grad()
        def metrics(self, x, y):
            logits = self.net(x)
            loss = F.cross_entropy(logits, y, reduction="sum")
            correct = (logits.argmax(1) == y).sum()
            return {"loss": Weighted(float(loss), len(y)),
                    "accuracy": Weighted(float(correct), len(y))}

    class BenchFedAvg(FederatedAveraging):
        """pfl's FedAvg with the per-user evaluation of evaluation iterations switched off
        and the local training loss reported as a metric."""

        def get_next_central_contexts(self, *a, **kw):
            contexts, model, metrics = super().get_next_central_contexts(*a, **kw)
            if contexts is not None:
                import dataclasses

                contexts = tuple(dataclasses.replace(c, do_evaluation=False)
                                 for c in contexts)
            return contexts, model, metrics

        def train_one_user(self, initial_model_state, model, user_dataset, central_context):
            module = model.pytorch_model
            module.loss_sum.zero_()
            module.steps = 0
            stats, metrics = super().train_one_user(initial_model_state, model,
                                                    user_dataset, central_context)
            # W's work: E * ceil(n_k / B) = 300 SGD steps for each client.
            assert module.steps == common.LOCAL_EPOCHS * -(-len(user_dataset)
                                                           // common.BATCH_SIZE), module.steps
            metrics[StringMetricName(LOSS_METRIC)] = Weighted(float(module.loss_sum),
                                                              module.steps)
            return stats, metrics

    arrays = load_mnist()
    x, y = tc.to_tensors(arrays["x_train"], arrays["y_train"])
    parts = iid(len(y), common.NUM_CLIENTS, common.SEED)
    users = {k: [x[torch.from_numpy(p)], y[torch.from_numpy(p)]]
             for k, p in enumerate(parts)}

    def cohort_ids():  # round t's clients, as fedax's runner and bench_torch.py draw them
        t = 0
        while True:
            yield from sample_clients(np.random.default_rng([common.SEED, t]),
                                      common.NUM_CLIENTS, common.CLIENT_FRACTION).tolist()
            t += 1

    ids = cohort_ids()
    train_data = FederatedDataset.from_slices(users, lambda: next(ids))

    module = PflModule(tc.build_model(args.model))
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(training_data=train_data, val_data=None,
                               postprocessors=[WeightByDatapoints()])
    total_rounds = args.warmup + args.rounds
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=total_rounds,
        evaluation_frequency=total_rounds + 1,
        train_cohort_size=common.COHORT_SIZE,
        val_cohort_size=0,
    )
    train_params = NNTrainHyperParams(
        local_learning_rate=common.CLIENT_LR,
        local_num_epochs=common.LOCAL_EPOCHS,
        local_batch_size=common.BATCH_SIZE,
    )

    test = None
    check: dict[str, dict[str, float]] = {}
    if args.check and rank == 0:
        xt, yt = tc.to_tensors(arrays["x_test"], arrays["y_test"])
        test = Dataset(raw_data=[xt, yt])

    def evaluate(label: str) -> None:
        if test is None:
            return
        m = model.evaluate(test, eval_params=NNEvalHyperParams(local_batch_size=1000))
        m = m.to_simple_dict(to_lowercase=True)
        check[label] = {"loss": m["loss"], "accuracy": m["accuracy"]}

    clock = common.RoundClock()
    losses: list[float] = []

    class RoundTimer(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            clock.mark()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            clock.mark()
            values = aggregate_metrics.to_simple_dict(to_lowercase=True)
            value = values.get(LOSS_METRIC, float("nan"))
            losses.append(float(value))
            return False, Metrics()

    evaluate("before")
    with common.RssMonitor() as rss:
        BenchFedAvg().run(
            algorithm_params=algorithm_params,
            backend=backend,
            model=model,
            model_train_params=train_params,
            callbacks=[RoundTimer()],
            send_metrics_to_platform=False,
        )
        for proc in peers:
            proc.wait(timeout=120)
    if any(p.returncode for p in peers):
        raise SystemExit(f"pfl worker exited with {[p.returncode for p in peers]}")
    if rank != 0:
        return 0
    evaluate("after")

    world = get_ops().distributed.world_size
    config = (f"{args.procs} proc{'s' if args.procs > 1 else ''} x {threads} "
              f"thread{'s' if threads > 1 else ''}")
    record = common.run_record(
        "pfl", config, args.model, clock, args.warmup, rss,
        train_losses=losses, packages=("pfl", "torch"),
        extra={"procs": args.procs, "threads": threads, "world_size": world,
               "api": "pfl FederatedAveraging + SimulatedBackend + PyTorchModel "
                      "(FederatedDataset.from_slices; multi-process: torch.distributed "
                      "gloo via PFL_WORKER_ADDRESSES/PFL_WORKER_RANK)",
               **({"check": check} if check else {})},
    )
    common.finish(record, args.json)
    if check:
        b, a = check["before"], check["after"]
        print(f"check: test loss {b['loss']:.4f} -> {a['loss']:.4f}, "
              f"accuracy {b['accuracy']:.4f} -> {a['accuracy']:.4f} after "
              f"{total_rounds} rounds; train loss by round {[round(v, 4) for v in losses]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
