"""What the runner's per-round checks cost: fedax now against an older fedax, alternated.

Since the "nothing lost" change, every round is checked before the next one is dispatched
(the server model is finite and few enough clients were rejected; both computed inside the
compiled round), and each client's update is tested for finiteness. An older runner only
synchronised at evaluations. This times ``fedax.simulation.run`` with one evaluation at the
end (so the old runner never waited between rounds) for both source trees, each in its own
process, alternating, and prints the ratio:

    git worktree add /tmp/fedax-base 4d0bfb1
    python benchmarks/bench_round_checks.py --baseline-src /tmp/fedax-base/src

Workloads: W (the 2NN, E = 5, B = 10, 10 of 100 IID MNIST clients: ``common.WORKLOAD``) and
a dispatch-bound one (E = 1, B = 50: 12 steps a client), where a per-round wait shows most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# name -> (E, B, rounds per --rounds): the small rounds are ~20x shorter, so 10x as many.
WORKLOADS = {"W": (common.LOCAL_EPOCHS, common.BATCH_SIZE, 1), "small": (1, 50, 10)}
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def child(workload: str, rounds: int) -> float:
    """Seconds per round of the fedax on ``sys.path``, compilation excluded."""
    import jax
    import optax

    from fedax.algorithms import fedavg
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation import Execution, run

    epochs, batch, scale = WORKLOADS[workload]
    rounds *= scale
    # Each run() compiles its round afresh; a persistent cache makes the second compilation
    # a cheap load, so that the difference of two runs is the rounds alone.
    jax.config.update("jax_compilation_cache_dir", os.environ["BENCH_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    model = get_model("2nn")
    params = jax.jit(model.init)(jax.random.key(common.SEED))
    train, _, _ = common.load_federated_mnist()

    def loss_fn(p, b):
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    def evaluate(server_params):
        jax.block_until_ready(server_params)
        return 0.0, 0.0

    def timed(n):
        start = time.perf_counter()
        run(fedavg(loss_fn, optax.sgd(common.CLIENT_LR)), params, train, evaluate, rounds=n,
            client_fraction=common.CLIENT_FRACTION, local_epochs=epochs, batch_size=batch,
            seed=common.SEED, eval_every=n, execution=Execution("sequential", "scan", 1))
        return time.perf_counter() - start

    timed(1)  # compile (and fill the cache)
    one = timed(1)
    return (timed(rounds + 1) - one) / rounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", help="the src/ folder of the older fedax")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--child", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import fedax

        print(json.dumps({"s_per_round": child(args.child, args.rounds),
                          "fedax": os.path.dirname(os.path.dirname(fedax.__file__))}))
        return 0
    if not args.baseline_src:
        parser.error("--baseline-src is required (see the module docstring)")
    trees = {"fedax": SRC, "baseline": os.path.abspath(args.baseline_src)}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    results: dict[str, dict[str, list[float]]] = {w: {t: [] for t in trees} for w in WORKLOADS}
    for p in range(args.passes):
        for workload in WORKLOADS:
            order = list(trees) if p % 2 == 0 else list(reversed(trees))
            for tree in order:
                with tempfile.TemporaryDirectory() as cache:
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", workload, "--rounds",
                         str(args.rounds)],
                        env=dict(env, PYTHONPATH=trees[tree], BENCH_CACHE_DIR=cache),
                        capture_output=True, text=True, check=True, timeout=900)
                answer = json.loads(out.stdout.strip().splitlines()[-1])
                if answer["fedax"] != trees[tree]:
                    raise SystemExit(f"{tree}: imported fedax from {answer['fedax']}")
                value = answer["s_per_round"]
                results[workload][tree].append(value)
                print(f"pass {p + 1} {workload:<5} {tree:<8} {value * 1e3:8.1f} ms/round",
                      flush=True)
    for workload, times in results.items():
        new, old = statistics.median(times["fedax"]), statistics.median(times["baseline"])
        print(f"{workload}: fedax {new * 1e3:.1f} ms/round, baseline {old * 1e3:.1f} "
              f"ms/round, fedax/baseline = {new / old:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
