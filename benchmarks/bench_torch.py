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
``--device cuda`` (with ``--procs 1``) trains on the GPU: model, data and each client's
steps there, the round's end synchronized before it is timed (``torch.cuda.synchronize``);
the record then holds the peak of PyTorch's CUDA allocator (``device_memory``).
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the loop trains (cuda: the first GPU, --procs 1 only)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.procs != 1:
        parser.error("--device cuda runs one process (--procs 1)")
    threads = common.threads_per_process(args)

    import torch
    import torch_common as tc

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    train, x_np, y_np = common.load_federated_mnist()
    net = tc.build_model(args.model).to(device)
    global_state = {k: v.detach().clone() for k, v in net.state_dict().items()}

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    workers = []
    with common.RssMonitor() as rss:
        clock = common.RoundClock()
        clock.mark()  # the first (warm-up) round also covers starting the workers
        if args.procs == 1:
            x, y = (t.to(device) for t in tc.to_tensors(x_np, y_np))
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
            synchronize()
            clock.mark()
        for proc, conn in workers:
            conn.send(None)
            proc.join(timeout=10)

    config = f"{args.procs} proc x {threads} thread" + ("s" if threads > 1 else "")
    extra = {"procs": args.procs, "threads": threads, "device": args.device,
             "torch_config": {"num_threads": torch.get_num_threads(),
                              "parallel_info": torch.__config__.parallel_info()}}
    if device.type == "cuda":
        config = f"cuda ({torch.cuda.get_device_name(device)})"
        extra["device_memory"] = {
            "peak_bytes_in_use": int(torch.cuda.max_memory_allocated(device)),
            "peak_bytes_reserved": int(torch.cuda.max_memory_reserved(device))}
        extra["torch_config"].update(
            cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
    record = common.run_record(
        "pytorch", config, args.model, clock, args.warmup, rss,
        train_losses=losses, packages=("torch",), extra=extra,
    )
    common.finish(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
