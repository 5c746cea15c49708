"""A hand-written PyTorch FedAvg loop on workload W: the baseline a practitioner writes.

    python benchmarks/bench_torch.py 2nn --procs 1 --threads 2 --rounds 5 --warmup 1
    python benchmarks/bench_torch.py 2nn --procs 2            # 2 worker processes x 1 thread

Same model, data and steps as fedax: each round's clients and batches are fedax's own
(``common.round_cohort``: the cohort ``fedax.simulation.run`` draws for that round), each
client runs its E·⌈n_k/B⌉ = 300 SGD steps from the global model, and the server takes the
n_k-weighted mean of the client models. ``--procs 1`` trains the clients one after another
in this process with ``--threads`` intra-op threads (default: one per core). ``--procs 2``
splits each round's clients over 2 long-lived worker processes (``multiprocessing``, spawn)
with 1 thread each; each returns its n_k-weighted sum of client models and this process
averages them. A round is timed from sampling the cohort to the new global model.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _worker(conn, model: str, threads: int) -> None:
    """A worker process: trains the clients it is sent, returns their weighted sum."""
    import torch
    import torch_common as tc

    torch.set_num_threads(threads)
    _, x_np, y_np = common.load_federated_mnist()
    x, y = tc.to_tensors(x_np, y_np)
    net = tc.build_model(model)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        global_np, clients = msg
        global_state = {k: torch.from_numpy(v) for k, v in global_np.items()}
        acc, weight, loss = None, 0.0, 0.0
        for n_k, batches in clients:
            state, client_loss = tc.train_client(net, global_state, x, y, batches,
                                                 common.CLIENT_LR)
            acc = tc.weighted_sum(acc, state, n_k)
            weight += n_k
            loss += n_k * client_loss
        conn.send(({k: v.numpy() for k, v in acc.items()}, weight, loss))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    common.add_process_args(parser)
    args = parser.parse_args(argv)
    threads = common.threads_per_process(args)

    import torch
    import torch_common as tc

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    train, x_np, y_np = common.load_federated_mnist()
    net = tc.build_model(args.model)
    global_state = {k: v.detach().clone() for k, v in net.state_dict().items()}

    workers = []
    with common.RssMonitor() as rss:
        clock = common.RoundClock()
        clock.mark()  # the first (warm-up) round also covers starting the workers
        if args.procs == 1:
            x, y = tc.to_tensors(x_np, y_np)
        else:
            ctx = mp.get_context("spawn")
            for _ in range(args.procs):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(child, args.model, threads),
                                   daemon=True)
                proc.start()
                workers.append((proc, parent))
            for _, conn in workers:
                assert conn.recv() == "ready"
        losses = []
        for t in range(args.warmup + args.rounds):
            _, idx, mask, num_examples = common.round_cohort(train, t)
            clients = [(float(n), common.client_batches(i, m))
                       for i, m, n in zip(idx, mask, num_examples, strict=True)]
            if args.procs == 1:
                acc, weight, loss = None, 0.0, 0.0
                for n_k, batches in clients:
                    state, client_loss = tc.train_client(net, global_state, x, y, batches,
                                                         common.CLIENT_LR)
                    acc = tc.weighted_sum(acc, state, n_k)
                    weight += n_k
                    loss += n_k * client_loss
            else:
                global_np = {k: v.numpy() for k, v in global_state.items()}
                for w, (_, conn) in enumerate(workers):
                    conn.send((global_np, clients[w :: args.procs]))
                acc, weight, loss = None, 0.0, 0.0
                for _, conn in workers:
                    part, part_weight, part_loss = conn.recv()
                    acc = tc.weighted_sum(acc, {k: torch.from_numpy(v) for k, v in
                                                part.items()}, 1.0)
                    weight += part_weight
                    loss += part_loss
            global_state = tc.scale(acc, 1.0 / weight)
            losses.append(loss / weight)
            clock.mark()
        for proc, conn in workers:
            conn.send(None)
            proc.join(timeout=10)

    config = f"{args.procs} proc x {threads} thread" + ("s" if threads > 1 else "")
    record = common.run_record(
        "pytorch", config, args.model, clock, args.warmup, rss,
        train_losses=losses, packages=("torch",),
        extra={"procs": args.procs, "threads": threads,
               "torch_config": {"num_threads": torch.get_num_threads(),
                                "parallel_info": torch.__config__.parallel_info()}},
    )
    common.finish(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
