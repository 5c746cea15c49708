"""The ``fedax`` command: ``run``, ``demo``, ``reproduce`` and ``data fetch``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

from fedax.cli.config import ConfigError, load_config

# The paper's rounds to 97% for the 2NN on pathological non-IID MNIST with C = 0.1, E = 1
# (McMahan et al. 2017, Table 1): B = ∞ (FedSGD) 1796 rounds, B = 10 (FedAvg) 664 rounds.
DEMO_RUNS = (
    ("FedSGD", "mnist_2nn_noniid_fedsgd", 1796),
    ("FedAvg", "mnist_2nn_noniid_fedavg", 664),
)


def resolve_config(name_or_path: str) -> Path:
    """A config file path, or the name of a config bundled with fedax."""
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = resources.files("fedax") / "configs" / f"{path.stem}.yaml"
    if bundled.is_file():
        return Path(str(bundled))
    names = sorted(p.name[:-5] for p in (resources.files("fedax") / "configs").iterdir()
                   if p.name.endswith(".yaml"))
    raise ConfigError(
        f"config {name_or_path!r} is neither a file nor a bundled config "
        f"(bundled: {', '.join(names)})"
    )


def cmd_run(args) -> int:
    from fedax.cli.experiment import run_experiment
    from fedax.simulation.checkpoint import CheckpointError

    config = load_config(resolve_config(args.config), args.set)
    out = Path(args.out or f"runs/{Path(args.config).stem}")
    try:
        summary = run_experiment(config, out, progress=not args.no_progress,
                                 resume=args.resume)
    except CheckpointError as err:
        raise ConfigError(f"cannot resume from {out / 'checkpoints'}: {err}") from None
    print(json.dumps({k: summary[k] for k in (
        "rounds_run", "final_test_accuracy", "best_test_accuracy", "rounds_to_target",
        "wall_time_s")}, indent=2))
    print(f"outputs in {out}/ (metrics.jsonl, summary.json, accuracy.png)")
    return 0


def cmd_demo(args) -> int:
    """FedAvg against FedSGD on pathological non-IID MNIST with the 2NN (Table 1 setting)."""
    from fedax.cli.experiment import fmt_rounds, plot_curves, run_experiment
    from fedax.simulation import History

    out = Path(args.out)
    rows, curves = [], {}
    for label, name, paper in DEMO_RUNS:
        config = load_config(resolve_config(name), args.set)
        print(f"== {label}: {name} (E={config.local_epochs}, B={config.batch_size}, "
              f"client_lr={config.client_lr}, up to {config.rounds} rounds)")
        summary = run_experiment(config, out / name, progress=not args.no_progress, label=label)
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").open()]
        curves[label] = History(records)
        rows.append((label, config, summary, paper))
    target = rows[0][1].target_accuracy
    plot_curves(curves, out / "accuracy.png", target)
    base = rows[0][2]["rounds_to_target"]
    lines = [
        f"Rounds to {target:.0%} test accuracy, 2NN, pathological non-IID MNIST, C = 0.1",
        "",
        "| method | E | B | client lr | rounds (fedax) | rounds (paper, Table 1) | "
        "speedup (fedax) | speedup (paper) | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, config, summary, paper in rows:
        ours = summary["rounds_to_target"]
        speed = f"{base / ours:.1f}x" if ours and base else "—"
        lines.append(
            f"| {label} | {config.local_epochs} | {config.batch_size} | {config.client_lr} | "
            f"{fmt_rounds(ours)} | {paper} | {speed} | {rows[0][3] / paper:.1f}x | "
            f"{summary['wall_time_s']:.0f} |"
        )
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print()
    print(table)
    print(f"\nplot: {out / 'accuracy.png'}")
    return 0


def cmd_reproduce(args) -> int:
    from fedax.reproduce import EXPERIMENTS, get_experiment, reproduce

    if args.list or not args.name:
        width = max(len(n) for n in EXPERIMENTS)
        for name in sorted(EXPERIMENTS):
            e = EXPERIMENTS[name]
            size = (f" ({len(e.full)} cells; --quick: {len(e.quick)})"
                    if hasattr(e, "full") else "")
            print(f"{name:<{width}}  {e.title}{size}")
        return 0
    try:
        get_experiment(args.name)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    out = Path(args.out or f"runs/reproduce/{args.name}" + ("-quick" if args.quick else ""))
    command = f"fedax reproduce {args.name}" + (" --quick" if args.quick else "")
    if args.out:
        command += f" --out {args.out}"
    results = reproduce(args.name, out, quick=args.quick, progress=not args.no_progress,
                        command=command)
    print(f"\nreport: {out / 'report.md'} ({results['wall_time_s'] / 60:.1f} min of runs)")
    return 0


def cmd_data_fetch(args) -> int:
    from fedax.data import fetch_mnist

    if args.name != "mnist":
        raise ConfigError(f"unknown data set {args.name!r} (available: mnist)")
    print(f"mnist ready in {fetch_mnist()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedax", description="Federated learning in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", help="a YAML file, or the name of a bundled config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (dotted keys for nested sections)")
    run.add_argument("--out", help="output directory (default runs/<config name>)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--resume", action="store_true",
        help="continue the run in --out from its newest valid checkpoint (OUT/checkpoints/, "
             "written every checkpoint_every rounds; set e.g. --set checkpoint_every=50 "
             "when starting the run). Same config and --set values required; the result "
             "(metrics.jsonl, final model) is identical to an uninterrupted run's, elapsed_s "
             "aside. Without a checkpoint, the run starts from round 0",
    )
    run.add_argument(
        "--devices", type=_positive_int, metavar="N",
        help="shard each cohort over N devices (CPU: the host split into N XLA devices; "
             "default one per core. GPU: the first N). Results equal one device's")
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="FedAvg vs FedSGD, 2NN, non-IID MNIST (Table 1)")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a key in both configs")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument(
        "--devices", type=_positive_int, metavar="N",
        help="shard each cohort over N devices (CPU: the host split into N XLA devices; "
             "default one per core. GPU: the first N). Results equal one device's")
    demo.set_defaults(func=cmd_demo)

    rep = sub.add_parser(
        "reproduce", help="run a paper experiment and write a report (--list names them)")
    rep.add_argument("name", nargs="?", help="the experiment (see --list)")
    rep.add_argument("--list", action="store_true", help="list the experiments")
    rep.add_argument("--quick", action="store_true",
                     help="the documented subset that runs in minutes on a laptop CPU")
    rep.add_argument("--out", help="report directory (default runs/reproduce/NAME[-quick]); "
                                   "rerunning into it reuses and resumes finished runs")
    rep.add_argument("--no-progress", action="store_true", help="no progress bars")
    rep.add_argument(
        "--devices", type=_positive_int, metavar="N",
        help="shard each cohort over N devices (CPU: the host split into N XLA devices; "
             "default one per core. GPU: the first N). Results equal one device's")
    rep.set_defaults(func=cmd_reproduce)

    data = sub.add_parser("data", help="data set commands")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    fetch = data_sub.add_parser("fetch", help="download and verify a data set into the cache")
    fetch.add_argument("name", choices=["mnist"])
    fetch.set_defaults(func=cmd_data_fetch)
    return parser


def split_host_into_devices(devices: int | None = None) -> None:
    """Before JAX starts: on CPU, expose ``devices`` XLA devices (default one per core), so
    that a cohort can be spread over the cores: one single-threaded client program per
    core is the fastest form on XLA:CPU. A count already in XLA_FLAGS is kept unless
    ``devices`` is given. With ``devices``, the runs also use only that many devices
    (``$FEDAX_DEVICES``; on GPU the first N)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if devices is not None:
        flags = " ".join(f for f in flags.split()
                         if "xla_force_host_platform_device_count" not in f)
        os.environ["FEDAX_DEVICES"] = str(devices)
    if "xla_force_host_platform_device_count" not in flags:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        count = devices if devices is not None else cores
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    split_host_into_devices(getattr(args, "devices", None))
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"fedax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
