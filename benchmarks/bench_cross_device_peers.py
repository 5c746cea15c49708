"""The cross-device workload on fedax's peers, one configuration a process.

    python benchmarks/bench_cross_device_peers.py pytorch --per-round 1000 --threads 1
    python benchmarks/bench_cross_device_peers.py pytorch --per-round 1000 --procs 2
    python benchmarks/bench_cross_device_peers.py flower --per-round 100 --cpus-per-client 1
    python benchmarks/bench_cross_device_peers.py pfl --per-round 100 --procs 2
    python benchmarks/bench_cross_device_peers.py fedax --per-round 100   # gpu/cross_device.py
    python benchmarks/bench_cross_device_peers.py flower --clients 200 --per-round 20 --rounds 2

The workload is ``cross_device.py``'s: N = ``--clients`` (10,000) MNIST clients of 20-100
examples with Dirichlet class mixes, the 2NN (784-200-200-10 ReLU, ``torch_common``'s PyTorch
model and initial weights), FedAvg with E = 1, B = 10, client SGD lr 0.05, the n_k-weighted
mean, K = ``--per-round`` distinct clients a round drawn uniformly at random. Each peer is set
up as its own documentation sets up many small clients (:data:`SETUP`, also the
"Configurations" paragraph of ``compare_cross_device.py``'s summary). ``fedax`` runs
``gpu/cross_device.py`` in this process, its host split into one XLA device per core (or
``--strategy``'s DEVICES) as ``bench_fedax.py`` and the ``fedax`` command split it, so that
``compare_cross_device.py`` starts every configuration the same way.

A round is timed as in the W benchmarks (``bench_torch.py``, ``bench_flower.py``,
``bench_pfl.py``): from the first round's start to each new global model, the first
``--warmup`` rounds left out of the statistics. The record (``common.run_record``) has seconds
per round, ``client_updates_per_s`` (K / the median), ``examples_per_s``, the peak RSS and PSS
of the process tree (Ray's processes and worker processes included), each round's training
loss (the n_k-weighted mean of the clients' mean batch losses) and the workload.

``--budget S`` (default 300) bounds the whole process, start-up included, to S seconds: when
they are up the run stops wherever it is, its record holds the rounds finished so far and
``cut_off`` says when (``rounds_done``, the round under way and for how long it had run), and
the process exits 0. (fedax's run has no budget of its own; ``compare_cross_device.py`` stops
it, as any run, ``--budget`` plus a minute after its start.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
import time

STARTED = time.perf_counter()  # the budget counts from here

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import cross_device as cd  # noqa: E402

IMPLS = ("pytorch", "flower", "pfl", "fedax")
CUT_OFF = threading.Event()  # set once the budget's thread has the record: it ends the process
DEFAULT_BUDGET_S = 300.0

# How each peer is set up for many small clients, and on whose advice; records carry their
# line, compare_cross_device.py's summary all of them.
SETUP = {
    "fedax": "fedax: `fedax.simulation.run` with the execution fedax picks itself "
             "(`choose_execution`: on CPU `sequential:scan` over one XLA device per core, as "
             "the `fedax` command splits the host; on a GPU `vmap:scan`); the population "
             "is one `ClientData` (an index table into MNIST), each round's cohort one "
             "`[K, S, B]` index batch gathered on the device.",
    "pytorch": "pytorch: the loop a practitioner writes: MNIST as one tensor, each client's "
               "batches as index arrays into it (its examples gathered per batch, no "
               "per-client copies), the clients of a round trained one after another from "
               "the global state (`load_state_dict`, a fresh SGD optimizer, a cloned state "
               "back), their n_k-weighted sum accumulated in place; `1 proc x T threads`, or "
               "`2 procs x 1 thread` (`bench_torch.py`'s long-lived worker processes, each "
               "sent half the cohort's batches and returning its weighted sum).",
    "flower": "flower: Flower's Simulation Engine (`flwr.simulation.run_simulation`, Ray "
              "backend; flwr 1.42 deprecates this entry point for `flwr run`, which starts "
              "the same engine in another process) with one virtual SuperNode per client "
              "(`num_supernodes` = N, `partition-id` = the client) and Flower's `FedAvg` "
              "(`fraction_train` = K/N, `min_train_nodes` = K, no evaluation). As Flower's "
              "'Run simulations' guide advises for many clients, ClientApps are ephemeral "
              "(only the K sampled ones run, queued onto the backend's workers) and each "
              "worker gets few resources: `client_resources.num_cpus` = 1 (one worker per "
              "core) so that as many run at once as there are cores; each Ray worker builds "
              "the population once and keeps it, a ClientApp only cuts its client's batches.",
    "pfl": "pfl: pfl-research's `SimulatedBackend` with `FederatedAveraging`, its "
           "`PyTorchModel` (local `torch.optim.SGD`, central SGD lr 1 so the new model is the "
           "mean) and `WeightByDatapoints`, over a `FederatedDataset` of the N users whose "
           "`make_dataset_fn` gathers a user's examples from MNIST in memory when sampled "
           "(pfl's form for many users; `from_slices` would hold a copy of every user's "
           "~500,000 examples), the user sampler yielding fedax's cohorts of K; `1 proc x T "
           "threads`, or `2 procs x 1 thread` (pfl's multi-process simulation over "
           "torch.distributed, with `user_id_to_weight` = n_k, which pfl's docs advise when "
           "users' sizes vary, to balance the processes). Per-user evaluation off.",
}


# ----------------------------------------------------------------------------- one run
class Run:
    """One configuration's run: its round clock, training losses and memory monitor.
    ``finish()`` writes its record once: from the main thread when the rounds are done, or
    from the budget's thread (:meth:`start_budget`) when the time is up, which then ends
    the process tree."""

    def __init__(self, args, impl: str, config: str, sizes, packages: tuple[str, ...],
                 extra: dict | None = None):
        self.args, self.impl, self.config = args, impl, config
        self.sizes, self.packages = sizes, packages
        self.extra = {"setup": SETUP[impl], **(extra or {})}
        self.clock = common.RoundClock()
        self.losses: list[float] = []
        self.rss = common.RssMonitor()
        self._lock = threading.Lock()
        self._written = False

    @property
    def total_rounds(self) -> int:
        return self.args.warmup + self.args.rounds

    def record(self) -> dict:
        a = self.args
        record = common.run_record(
            self.impl, self.config, cd.MODEL, self.clock, a.warmup, self.rss,
            train_losses=self.losses, packages=self.packages,
            extra={**self.extra, "budget_s": a.budget,
                   "startup_s": (self.clock.marks[0].wall - STARTED
                                 if self.clock.marks else None)})
        record["workload"] = cd.workload(self.sizes, a.clients, a.per_round, a.alpha,
                                         cd.MODEL, a.seed)
        cd.add_rates(record, a.per_round, float(self.sizes.mean()))
        return record

    def finish(self, cut_off: dict | None = None) -> bool:
        """Write the record (with ``cut_off``), unless it was already written."""
        with self._lock:
            if self._written:
                return False
            self._written = True
            record = self.record()
            if cut_off:
                record["cut_off"] = cut_off
                CUT_OFF.set()
            common.finish(record, self.args.json)
            return True

    def done(self) -> None:
        """The rounds are over: write the record, or wait for the budget's thread, which
        has written it and ends the process."""
        if not self.finish():
            threading.Event().wait()

    def start_budget(self) -> None:
        threading.Thread(target=self._expire, daemon=True, name="budget").start()

    def _expire(self) -> None:
        time.sleep(max(STARTED + self.args.budget - time.perf_counter(), 0.0))
        marks = list(self.clock.marks)
        now = time.perf_counter()
        done = max(len(marks) - 1, 0)
        cut_off = {
            "budget_s": self.args.budget, "rounds_done": done,
            "rounds_planned": self.total_rounds,
            "phase": ("start-up" if not marks
                      else "warm-up" if done < self.args.warmup else "measured rounds"),
            "in_round": done + 1 if marks else None,
            "round_running_s": now - marks[-1].wall if marks else None,
            "startup_s": marks[0].wall - STARTED if marks else now - STARTED,
        }
        if not self.finish(cut_off):
            return
        print(f"cut off after {self.args.budget:g} s: {done} of {self.total_rounds} rounds "
              "done", flush=True)
        try:
            import psutil

            common.terminate_processes(psutil.Process().children(recursive=True), 3.0)
        except ImportError:
            pass
        os._exit(0)


def _train_clients(net, global_state, x, y, clients, lr):
    """Clients one after another from ``global_state``: ``(Σ n_k·state_k, Σ n_k,
    Σ n_k·loss_k)``."""
    import torch_common as tc

    acc, weight, loss = None, 0.0, 0.0
    for n_k, batches in clients:
        state, client_loss = tc.train_client(net, global_state, x, y, batches, lr)
        acc = tc.weighted_sum(acc, state, n_k)
        weight, loss = weight + n_k, loss + n_k * client_loss
    return acc, weight, loss


def _train_in_workers(workers, global_state, clients):
    """The same over ``bench_torch.py``'s worker processes ``[(process, pipe)]``, worker w
    given every len(workers)-th client: the sums of their parts."""
    import torch

    sent = {k: v.numpy() for k, v in global_state.items()}
    for w, (_, conn) in enumerate(workers):
        conn.send((sent, clients[w :: len(workers)]))
    parts = [conn.recv() for _, conn in workers]
    acc = {k: sum(torch.from_numpy(p[0][k]) for p in parts) for k in parts[0][0]}
    return acc, sum(p[1] for p in parts), sum(p[2] for p in parts)


# ----------------------------------------------------------------------------- pytorch
def run_pytorch(args) -> Run:
    import multiprocessing as mp

    import bench_torch
    import torch
    import torch_common as tc

    # bench_torch's workers train at W's client lr: the same 0.05.
    assert common.CLIENT_LR == cd.CLIENT_LR
    threads = common.threads_per_process(args)
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    train, x_np, y_np = cd.load_population(args.clients, args.alpha, args.seed)
    run = Run(args, "pytorch", f"{args.procs} proc{'s' if args.procs > 1 else ''} x "
              f"{threads} thread{'s' if threads > 1 else ''}", train.sizes, ("torch",),
              {"procs": args.procs, "threads": threads})
    run.start_budget()
    net = tc.build_model(cd.MODEL)
    global_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    workers = []
    with run.rss:
        run.clock.mark()  # the first (warm-up) round also covers starting the workers
        x, y = tc.to_tensors(x_np, y_np)
        if args.procs > 1:
            ctx = mp.get_context("spawn")
            pipes = [ctx.Pipe() for _ in range(args.procs)]
            workers = [(ctx.Process(target=bench_torch._worker, daemon=True,
                                    args=(child, cd.MODEL, threads)), parent)
                       for parent, child in pipes]
            for proc, _ in workers:
                proc.start()
            assert all(conn.recv() == "ready" for _, conn in workers)
        for t in range(run.total_rounds):
            _, clients = cd.round_clients(train, t, args.per_round, args.seed)
            if workers:
                acc, weight, loss = _train_in_workers(workers, global_state, clients)
            else:
                acc, weight, loss = _train_clients(net, global_state, x, y, clients,
                                                   cd.CLIENT_LR)
            global_state = tc.scale(acc, 1.0 / weight)
            run.losses.append(loss / weight)
            run.clock.mark()
        for proc, conn in workers:
            conn.send(None)
            proc.join(timeout=10)
    return run


# ----------------------------------------------------------------------------- flower
_FLOWER_WORKER: dict = {}


def flower_train(msg, context):
    """The ClientApp's train function. Ray's workers import it from this module by name
    (Flower's Ray backend gives them the driver's ``sys.path``); each builds the population
    once, on its first message, and keeps it."""
    import torch
    import torch_common as tc
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    config = msg.content["config"]
    key = (int(config["num-clients"]), float(config["alpha"]), int(config["seed"]))
    if _FLOWER_WORKER.get("key") != key:
        torch.set_num_threads(int(config["threads"]))
        train, x_np, y_np = cd.load_population(*key)
        x, y = tc.to_tensors(x_np, y_np)
        _FLOWER_WORKER.update(key=key, train=train, x=x, y=y, net=tc.build_model(cd.MODEL))
    w = _FLOWER_WORKER
    k = int(context.node_config["partition-id"])
    t = int(config["server-round"]) - 1  # fedax's rounds count from 0
    _, [(n_k, batches)] = cd.round_clients(w["train"], t, 1, key[2], client_ids=[k])
    state, loss = tc.train_client(w["net"], msg.content["arrays"].to_torch_state_dict(),
                                  w["x"], w["y"], batches, float(config["lr"]))
    return Message(content=RecordDict({
        "arrays": ArrayRecord(state),
        "metrics": MetricRecord({"train_loss": loss, "num-examples": int(n_k)})}),
        reply_to=msg)


def run_flower(args) -> Run:
    import logging

    # The train function from this module imported by name, not from __main__, so that Ray
    # pickles a reference to it and its workers keep their population between messages.
    import bench_cross_device_peers as named
    import torch_common as tc
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    if not args.verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    cpus = args.cpus_per_client
    cores = common.num_cores()
    train, _, _ = cd.load_population(args.clients, args.alpha, args.seed)
    backend_config = {"client_resources": {"num_cpus": cpus, "num_gpus": 0.0},
                      "init_args": {"num_cpus": cores}}
    run = Run(args, "flower", f"{cpus} cpu/client ({cores // cpus} concurrent)", train.sizes,
              ("flwr", "ray", "torch"),
              {"cpus_per_client": cpus, "backend_config": backend_config,
               "api": "flwr.simulation.run_simulation + ServerApp/ClientApp (Message API), "
                      "flwr.serverapp.strategy.FedAvg"})
    run.start_budget()
    clock = run.clock

    class TimedFedAvg(FedAvg):
        """Flower's FedAvg; round t ends when ``aggregate_train`` has the new model."""

        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            clock.mark()
            run.losses.append(float(out[1]["train_loss"]) if out[1] else float("nan"))
            return out

    def rounds_start(server_round, arrays):
        """``evaluate_fn``, which the strategy calls with the initial model before round 1
        (and after each round): the clock starts there."""
        if server_round == 0:
            clock.mark()

    server_app = ServerApp()

    @server_app.main()
    def server_main(grid, context):
        strategy = TimedFedAvg(fraction_train=args.per_round / args.clients,
                               fraction_evaluate=0.0, min_train_nodes=args.per_round,
                               min_available_nodes=args.clients)
        strategy.start(
            grid=grid, initial_arrays=ArrayRecord(tc.build_model(cd.MODEL).state_dict()),
            num_rounds=run.total_rounds, evaluate_fn=rounds_start,
            train_config=ConfigRecord({"lr": cd.CLIENT_LR, "num-clients": args.clients,
                                       "alpha": args.alpha, "seed": args.seed,
                                       "threads": cpus}))

    client_app = ClientApp()
    client_app.train()(named.flower_train)
    with run.rss:
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=args.clients, backend_name="ray",
                       backend_config=backend_config)
    if len(clock.marks) != run.total_rounds + 1:
        raise SystemExit(f"Flower ran {max(len(clock.marks) - 1, 0)} of "
                         f"{run.total_rounds} rounds; see the log")
    return run


# ----------------------------------------------------------------------------- pfl
class FedaxCohorts:
    """pfl's user sampler (``callable() -> user id``): the clients of fedax's round 0, then
    round 1, ... (``cross_device.round_clients``'s draw), client k of round t as the user id
    ``t·N + k``, so that the user's data set (:func:`pfl_user_order`) can hold exactly
    fedax's batches of that round. A plain object: pfl pickles it into the sampling process
    of its multi-process simulation."""

    def __init__(self, num_clients: int, per_round: int, seed: int):
        self.num_clients, self.per_round, self.seed = num_clients, per_round, seed
        self.t, self.queue = 0, []

    def __call__(self) -> int:
        if not self.queue:
            from fedax.data import sample_clients

            rng = np.random.default_rng([self.seed, self.t])
            ids = sample_clients(rng, self.num_clients, self.per_round / self.num_clients)
            self.queue = sorted((self.t * self.num_clients + ids).tolist(), reverse=True)
            self.t += 1
        return self.queue.pop()


class UserSizes:
    """pfl's ``user_id_to_weight`` for :class:`FedaxCohorts`'s ids: n_k of user ``t·N + k``."""

    def __init__(self, sizes: np.ndarray):
        self.sizes = sizes

    def __getitem__(self, user_id: int) -> int:
        return int(self.sizes[user_id % len(self.sizes)])


def pfl_user_order(train, user_id: int, seed: int) -> np.ndarray:
    """User ``t·N + k``'s examples in the order of fedax's round-t batches of client k: pfl
    walks a user's data set in order, in batches of B, so with E = 1 it takes those very
    batches (pfl itself never reshuffles a user's examples)."""
    t, k = divmod(int(user_id), train.num_clients)
    _, [(_, batches)] = cd.round_clients(train, t, 1, seed, client_ids=[k])
    return np.concatenate(batches)


def run_pfl(args) -> Run | None:
    import dataclasses

    rank = args.worker_rank
    threads = common.threads_per_process(args)
    peers = []
    # pfl reads these when its PyTorch ops are imported, so set them (and start the other
    # ranks) first; bench_pfl.py's launch.
    if args.procs > 1 and rank == 0:
        from bench_pfl import launch_ranks

        peers = launch_ranks(args.procs, lambda r: [
            sys.executable, os.path.abspath(__file__), "pfl",
            *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
                "per_round", "clients", "alpha", "rounds", "warmup", "seed", "budget",
                "procs")),
            f"--threads={threads}", f"--worker-rank={r}"])

    import torch
    import torch.nn.functional as F
    import torch_common as tc
    from torch import nn

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)

    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics, StringMetricName, Weighted
    from pfl.model.pytorch import PyTorchModel

    train, x_np, y_np = cd.load_population(args.clients, args.alpha, args.seed)
    x, y = tc.to_tensors(x_np, y_np)
    sizes = train.sizes
    config = (f"{args.procs} proc{'s' if args.procs > 1 else ''} x {threads} "
              f"thread{'s' if threads > 1 else ''}")
    run = Run(args, "pfl", config, sizes, ("pfl", "torch"),
              {"procs": args.procs, "threads": threads})
    if rank == 0:
        run.start_budget()
    loss_name = StringMetricName("train loss")

    class Net(nn.Module):
        """The 2NN with the ``loss``/``metrics`` pfl calls; ``loss`` counts the steps and
        sums the (detached) batch losses of the user being trained."""

        def __init__(self):
            super().__init__()
            self.net = tc.build_model(cd.MODEL)
            self.seen = [0, 0.0]

        def forward(self, inputs):
            return self.net(inputs)

        def loss(self, inputs, labels):
            value = F.cross_entropy(self.net(inputs), labels)
            self.seen[0] += 1
            self.seen[1] += float(value.detach())
            return value

        @torch.no_grad()
        def metrics(self, inputs, labels):
            return {"loss": Weighted(float(F.cross_entropy(self.net(inputs), labels,
                                                             reduction="sum")), len(labels))}

    class FedAvgNoEval(FederatedAveraging):
        """pfl's FedAvg, no per-user evaluation; each user's mean batch loss reported,
        weighted by n_k, as the round's training loss."""

        def simulate_one_user(self, model, user_dataset, central_context):
            # evaluation iterations (iteration 0) evaluate each user before and after
            # training: not part of a round here
            quiet = dataclasses.replace(central_context, do_evaluation=False)
            return super().simulate_one_user(model, user_dataset, quiet)

        def train_one_user(self, initial_model_state, model, user_dataset, central_context):
            seen = model.pytorch_model.seen
            seen[:] = [0, 0.0]
            stats, metrics = super().train_one_user(initial_model_state, model, user_dataset,
                                                    central_context)
            n_k = len(user_dataset)
            assert seen[0] == -(-n_k // cd.BATCH_SIZE), (seen[0], n_k)  # E = 1
            metrics[loss_name] = Weighted(n_k * seen[1] / seen[0], n_k)
            return stats, metrics

    def user_dataset(user_id):
        index = torch.from_numpy(pfl_user_order(train, user_id, args.seed))
        return Dataset(raw_data=[x[index], y[index]], user_id=user_id)

    weights = UserSizes(sizes) if args.procs > 1 else None
    data = FederatedDataset(user_dataset, FedaxCohorts(args.clients, args.per_round, args.seed),
                            user_id_to_weight=weights)
    module = Net()
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    backend = SimulatedBackend(training_data=data, val_data=None,
                               postprocessors=[WeightByDatapoints()])
    clock = run.clock

    class RoundTimer(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            clock.mark()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            clock.mark()
            values = aggregate_metrics.to_simple_dict(to_lowercase=True)
            run.losses.append(float(values.get(str(loss_name), float("nan"))))
            return False, Metrics()

    with run.rss:
        FedAvgNoEval().run(
            algorithm_params=NNAlgorithmParams(
                central_num_iterations=run.total_rounds,
                evaluation_frequency=run.total_rounds + 1,
                train_cohort_size=args.per_round, val_cohort_size=0),
            backend=backend, model=model,
            model_train_params=NNTrainHyperParams(
                local_learning_rate=cd.CLIENT_LR, local_num_epochs=cd.LOCAL_EPOCHS,
                local_batch_size=cd.BATCH_SIZE),
            callbacks=[RoundTimer()], send_metrics_to_platform=False)
        for proc in peers:
            proc.wait(timeout=120)
    if any(p.returncode for p in peers):
        raise SystemExit(f"pfl worker exited with {[p.returncode for p in peers]}")
    return run if rank == 0 else None


# ----------------------------------------------------------------------------- fedax
def run_fedax(args) -> int:
    """``gpu/cross_device.py`` in this process, the host split as ``bench_fedax.py`` does."""
    from bench_fedax import parse_strategy, split_host

    strategy = parse_strategy(args.strategy)
    split_host(common.num_cores() if strategy is None else strategy[2])
    spec = importlib.util.spec_from_file_location(
        "gpu_cross_device", os.path.join(HERE, "gpu", "cross_device.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--per-round", str(args.per_round), "--clients", str(args.clients),
            "--alpha", str(args.alpha), "--strategy", args.strategy,
            "--rounds", str(args.rounds), "--warmup", str(args.warmup),
            "--seed", str(args.seed)]
    return module.main(argv + (["--json", args.json] if args.json else []))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("impl", choices=IMPLS)
    parser.add_argument("--per-round", type=int, required=True, help="K, clients a round")
    parser.add_argument("--clients", type=int, default=cd.NUM_CLIENTS, help="N, the population")
    parser.add_argument("--alpha", type=float, default=cd.ALPHA, help="Dirichlet concentration")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before measuring")
    parser.add_argument("--seed", type=int, default=cd.SEED)
    parser.add_argument("--json", default=None, help="write the record here")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for the whole run, start-up included (not fedax)")
    common.add_process_args(parser)  # --procs, --threads: pytorch, pfl
    parser.add_argument("--cpus-per-client", type=int, default=1,
                        help="flower: Ray CPUs (and torch threads) per ClientApp")
    parser.add_argument("--strategy", default="default",
                        help="fedax: MAP:STEPS:DEVICES or default")
    parser.add_argument("--verbose", action="store_true", help="flower: Flower's INFO logs")
    parser.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.per_round <= args.clients:
        parser.error(f"--per-round must lie in [1, {args.clients}]")
    if args.procs > 1 and args.impl not in ("pytorch", "pfl"):
        parser.error("--procs applies to pytorch and pfl")
    if args.impl == "fedax":
        return run_fedax(args)
    try:
        run = {"pytorch": run_pytorch, "flower": run_flower, "pfl": run_pfl}[args.impl](args)
    except BaseException:
        if CUT_OFF.is_set():  # the budget's thread stopped the workers under the run's feet
            threading.Event().wait()  # and ends the process with the record written
        raise
    if run is not None:
        run.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
