"""Flower's simulation engine (Ray backend) on workload W, with the PyTorch clients of
bench_torch.py.

    python benchmarks/bench_flower.py 2nn --cpus-per-client 1 --rounds 5 --warmup 1

The ServerApp runs Flower's own ``FedAvg`` strategy (Message API, ``flwr.serverapp``:
``fraction_train=0.1`` of 100 virtual clients, n_k-weighted averaging by "num-examples",
no federated evaluation) through ``flwr.simulation.run_simulation`` with the Ray backend:
each client gets ``--cpus-per-client`` Ray CPUs, so ``cores // cpus`` clients train at a
time, in long-lived Ray actors. ``flwr.simulation.run_simulation`` is the in-process Python
entry point (flwr 1.42 marks it deprecated in favour of ``flwr run``, which starts the same
Simulation Runtime from a Flower App project in a separate process); it keeps the engine
in this process tree, where its CPU time and memory are measured.

Rounds are timed on the server side, by a ``FedAvg`` subclass: round t ends when
``aggregate_train`` has the new global model; the first round starts when the strategy
configures it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="Flower's INFO logs")
    args = parser.parse_args(argv)

    import logging

    import flower_client
    import torch_common as tc
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    # Read by the Ray workers, which inherit this environment.
    os.environ[flower_client.THREADS_ENV] = str(args.cpus_per_client)
    os.environ[flower_client.MODEL_ENV] = args.model
    if not args.verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)

    clock = common.RoundClock()
    losses: list[float] = []

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            if not clock.marks:
                clock.mark()
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            arrays, metrics = super().aggregate_train(server_round, replies)
            clock.mark()
            losses.append(float(metrics["train_loss"]) if metrics else float("nan"))
            return arrays, metrics

    total_rounds = args.warmup + args.rounds
    server_app = ServerApp()

    @server_app.main()
    def server_main(grid, context):
        strategy = TimedFedAvg(
            fraction_train=common.CLIENT_FRACTION,
            fraction_evaluate=0.0,
            min_train_nodes=common.COHORT_SIZE,
            min_available_nodes=common.NUM_CLIENTS,
        )
        net = tc.build_model(args.model)
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(net.state_dict()),
            num_rounds=total_rounds,
            train_config=ConfigRecord({"lr": common.CLIENT_LR}),
        )

    cores = common.num_cores()
    backend_config = {
        "client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0},
        "init_args": {"num_cpus": cores},
    }
    with common.RssMonitor() as rss:
        run_simulation(
            server_app=server_app,
            client_app=flower_client.app,
            num_supernodes=common.NUM_CLIENTS,
            backend_name="ray",
            backend_config=backend_config,
        )
    if len(clock.marks) != total_rounds + 1:
        raise SystemExit(
            f"Flower ran {max(len(clock.marks) - 1, 0)} of {total_rounds} rounds; see the log"
        )
    record = common.run_record(
        "flower", f"{args.cpus_per_client} cpu/client ({cores // args.cpus_per_client} "
        "concurrent)", args.model, clock, args.warmup, rss,
        train_losses=losses, packages=("flwr", "ray", "torch"),
        extra={"cpus_per_client": args.cpus_per_client, "backend_config": backend_config,
               "api": "flwr.simulation.run_simulation + ServerApp/ClientApp (Message API), "
                      "flwr.serverapp.strategy.FedAvg"},
    )
    common.finish(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
