"""``fedax demo``: a reproduction, the quick subset of the FedAvg 2NN table restricted to
its Table 1 comparison: FedSGD against FedAvg (E = 1, B = 10) on pathological non-IID MNIST
with the 2NN (McMahan et al. 2017), written by the same engine and report code as
``fedax reproduce fedavg-mnist-2nn --quick``. Finished runs are reused and interrupted ones
resumed; ``--set`` overrides a key in both cells' configs."""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import replace
from pathlib import Path

from fedax.cli.options import DEVICES_HELP, SET_HELP, positive_int
from fedax.cli.run_dirs import (
    finish_pending_work,
    missing_dirs,
    os_error_message,
    remove_if_empty,
)
from fedax.spec.errors import CommandError

PAPER = "fedavg-mnist-2nn"
CELLS = ("fedsgd-e1-binf-pathological", "fedavg-e1-b10-pathological")


def add_command(sub, common) -> None:
    """Adds ``fedax demo`` to the subcommands ``sub``."""
    demo = sub.add_parser("demo", help="FedAvg vs FedSGD, 2NN, non-IID MNIST (Table 1)",
                          parents=[common])
    demo.add_argument("--out", default="runs/demo",
                      help="report directory (default runs/demo); finished runs of the same "
                           "config there are reused, interrupted ones resumed")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a key in both cells' configs; "
                           + SET_HELP.split("; ")[1])
    demo.add_argument("--overwrite", action="store_true",
                      help="rerun every run, replacing the runs --out holds")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--devices", type=positive_int, metavar="N", help=DEVICES_HELP)
    demo.set_defaults(func=cmd_demo)


def demo_paper(sets: list[str]):
    """The 2NN paper with its quick subset cut to the demo's cells, each cell's config
    overridden by ``sets`` (``KEY=VALUE``, checked against the config schema)."""
    from fedax.reproduce import EXPERIMENTS
    from fedax.spec.config import Config, apply_override

    paper = EXPERIMENTS[PAPER]
    cells = []
    for cell in paper.quick:
        if cell.name in CELLS:
            config = json.loads(json.dumps(dict(cell.config)))
            for item in sets:
                apply_override(config, item, Config)
            cells.append(replace(cell, config=config))
    return replace(paper, quick=tuple(cells))


def _foreign_runs(paper, out: Path) -> list[Path]:
    """Finished runs in ``out/runs`` of a config that is none of this demo's (whatever
    their rounds: a grid point stops at a cap), which the demo would replace."""
    from fedax.reproduce.runs import cell_config, same_config
    from fedax.spec.config import config_to_dict

    wanted = [config_to_dict(cell_config(paper, cell, lr))
              for cell in paper.quick for lr in cell.lrs]
    foreign = []
    for summary in sorted((out / "runs").glob("*/*/summary.json")):
        saved = json.loads(summary.read_text()).get("config", {})
        if not any(same_config({**saved, "rounds": w["rounds"]}, w) for w in wanted):
            foreign.append(summary.parent)
    return foreign


def cmd_demo(args) -> int:
    """FedAvg against FedSGD on pathological non-IID MNIST with the 2NN (Table 1 setting)."""
    from fedax.reproduce import reproduce

    sets = list(args.set) + ([f"execution.devices={args.devices}"] if args.devices else [])
    paper = demo_paper(sets)
    out = Path(args.out)
    command = shlex.join(["fedax", "demo", "--out", args.out,
                          *[x for item in args.set for x in ("--set", item)],
                          *(["--devices", str(args.devices)] if args.devices else [])])
    foreign = _foreign_runs(paper, out)
    if foreign and not args.overwrite:
        raise CommandError(f"{foreign[0]} holds a run of another config; delete it to run "
                           f"it again, pass --overwrite to rerun all, or choose another --out",
                           2)
    if args.overwrite and (out / "runs").exists():
        shutil.rmtree(out / "runs")
    created = missing_dirs(out)
    try:
        results = reproduce(paper, out, quick=True, progress=not args.no_progress,
                            command=command)
    except BaseException as err:
        for directory in sorted(out.rglob("*"), reverse=True):  # deepest first
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()  # the run directories this failed attempt left empty
        remove_if_empty(created)
        if isinstance(err, KeyboardInterrupt):
            finish_pending_work()
            raise CommandError(f"stopped; continue with: {command} (finished runs in {out} "
                               "are reused, unfinished ones resume from their newest "
                               "checkpoint)", 130, "interrupted") from err
        if isinstance(err, OSError):
            raise CommandError(os_error_message(err, out)) from err
        raise
    report = (out / "report.md").read_text()
    print("\n" + "\n".join(line for line in report.splitlines() if line.startswith("|")))
    print(f"\nreport: {out / 'report.md'}, plot: {out / results['figures'][0]}")
    return 0
