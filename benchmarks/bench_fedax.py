"""fedax on workload W, one execution strategy per process.

    python benchmarks/bench_fedax.py 2nn --strategy default --rounds 5 --warmup 1 --json out.json
    python benchmarks/bench_fedax.py cnn --strategy sequential:scan:2 --conv-impl lax_vjp

``--strategy MAP:STEPS:DEVICES`` is an ``Execution(map, steps, devices)``; ``default`` is what
fedax picks (``choose_execution()``) on a host split like the ``fedax`` command splits it,
one XLA device per core. The host is split into DEVICES XLA devices (``--host-devices``
overrides) with ``XLA_FLAGS=--xla_force_host_platform_device_count``, which must be set
before JAX starts: hence one configuration per process.

Rounds run through the real runner, ``fedax.simulation.run`` with ``eval_every=1``, and an
"evaluation" that only waits for the round's parameters (``jax.block_until_ready``) and
timestamps the round boundary. A round is thus exactly what a user's round costs: sampling,
host-side cohort batching, dispatch, the compiled round, the loss read-back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MAPS = ("vmap", "sequential", "unroll", "processes")
STEPS = ("scan", "unroll")


def parse_strategy(text: str) -> tuple[str, str, int] | None:
    if text == "default":
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in MAPS or parts[1] not in STEPS or not parts[2].isdigit():
        raise SystemExit(
            f"--strategy must be 'default' or MAP:STEPS:DEVICES with MAP in {MAPS}, "
            f"STEPS in {STEPS}, DEVICES >= 1; got {text!r}"
        )
    return parts[0], parts[1], int(parts[2])


def split_host(devices: int) -> None:
    """XLA:CPU shows ``devices`` devices (set before importing JAX; respects XLA_FLAGS)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--strategy", default="default", help="MAP:STEPS:DEVICES or default")
    parser.add_argument("--conv-impl", choices=("auto", "lax", "patches", "lax_vjp"), default=None,
                        help="CNN convolution form (default: the model's default)")
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: fedax.models.mixed_precision (float32 master weights) "
                             "with YNNPACK products, as `precision: bfloat16` runs")
    parser.add_argument("--host-devices", type=int, default=None,
                        help="XLA host devices (default: DEVICES, or one per core for default)")
    parser.add_argument("--print-default", action="store_true",
                        help="print the execution fedax picks by default, as JSON, and exit")
    args = parser.parse_args(argv)
    strategy = parse_strategy(args.strategy)
    host_devices = args.host_devices or (common.num_cores() if strategy is None else strategy[2])
    split_host(host_devices)

    import jax

    import fedax
    from fedax.models import get_model
    from fedax.simulation import Execution, choose_execution, run

    model_kwargs = {}
    if args.model == "cnn" and args.conv_impl is not None:
        model_kwargs["conv_impl"] = args.conv_impl
    elif args.conv_impl is not None:
        parser.error("--conv-impl applies to the CNN only")
    from fedax.models import with_precision
    from fedax.simulation.host import cpu_dots_for, preferred_cpu_dots

    model = with_precision(get_model(args.model, **model_kwargs), args.precision)
    params = jax.jit(model.init)(jax.random.key(common.SEED))
    execution = (choose_execution(params=params) if strategy is None
                 else Execution(*strategy).validate())
    if args.print_default:
        print(json.dumps({**execution._asdict(), "host_devices": jax.device_count()}))
        return 0
    train, _, _ = common.load_federated_mnist()

    algorithm, clock, timing_evaluate = common.timed_fedavg(model, common.CLIENT_LR)
    losses: list[float] = []

    exec_text = ":".join(str(v) for v in execution)
    config = exec_text if strategy is not None else f"default ({exec_text})"
    if model_kwargs:
        config += f" conv={args.conv_impl}"
    if args.precision != "float32":
        config += f" {args.precision}"
    dots = preferred_cpu_dots(cpu_dots_for(args.model, args.precision))
    with common.RssMonitor() as rss, dots:
        clock.mark()
        run(
            algorithm,
            params,
            train,
            timing_evaluate,
            rounds=args.warmup + args.rounds,
            client_fraction=common.CLIENT_FRACTION,
            local_epochs=common.LOCAL_EPOCHS,
            batch_size=common.BATCH_SIZE,
            seed=common.SEED,
            eval_every=1,
            execution=execution,
            callbacks=[lambda record: losses.append(record["train_loss"])],
        )
    record = common.run_record(
        "fedax", config, args.model, clock, args.warmup, rss,
        train_losses=losses, packages=("jax", "jaxlib", "optax"),
        extra={
            "execution": execution._asdict(),
            "host_devices": jax.device_count(),
            "conv_impl": args.conv_impl,
            "precision": args.precision,
            "fedax_version": fedax.__version__,
            "backend": jax.default_backend(),
            "device": common.jax_device_info(),
            # the allocator's peak on the device (None on CPU: the RSS above is the memory)
            "device_memory": common.jax_device_memory(),
        },
    )
    common.finish(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
