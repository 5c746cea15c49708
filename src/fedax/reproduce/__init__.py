"""``fedax reproduce NAME``: the papers' experiments, run end to end, with a report.

``EXPERIMENTS`` maps each name to its :class:`Experiment`; ``reproduce(name, out_dir,
quick=...)`` runs it and writes ``results.json``, ``report.md`` and the figures.
"""

from __future__ import annotations

import os
from typing import Any

from fedax.reproduce.compression_paper import COMPRESSION
from fedax.reproduce.dp_paper import ADAPTIVE_CLIPPING, DP_FEDAVG_MNIST
from fedax.reproduce.fad_client_weights import CLIENT_WEIGHTS
from fedax.reproduce.fad_server_lr import SERVER_LR
from fedax.reproduce.fedavg_paper import MNIST_2NN, MNIST_CNN, SHAKESPEARE
from fedax.reproduce.fedbuff_paper import FEDBUFF
from fedax.reproduce.fedopt_paper import FEDOPT_FASHION
from fedax.reproduce.fedprox_paper import FEDPROX_SYNTHETIC
from fedax.reproduce.framework import (
    Cell,
    CustomExperiment,
    Experiment,
    cell_config,
    machine_info,
    run_cell,
    save_results,
)
from fedax.reproduce.framework import reproduce as reproduce_experiment
from fedax.reproduce.robust_paper import ROBUST_AGGREGATION
from fedax.reproduce.scaffold_paper import SCAFFOLD_MNIST

# Each module defines its experiments; add new ones to this tuple.
EXPERIMENTS: dict[str, Experiment | CustomExperiment] = {
    e.name: e for e in (MNIST_2NN, MNIST_CNN, SHAKESPEARE, SERVER_LR, CLIENT_WEIGHTS,
                        SCAFFOLD_MNIST, FEDPROX_SYNTHETIC, FEDOPT_FASHION,
                        ADAPTIVE_CLIPPING, DP_FEDAVG_MNIST, COMPRESSION, ROBUST_AGGREGATION,
                        FEDBUFF)
}


def get_experiment(name: str) -> Experiment | CustomExperiment:
    if name not in EXPERIMENTS:
        raise KeyError(
            f"unknown experiment {name!r}; available: {', '.join(sorted(EXPERIMENTS))}"
        )
    return EXPERIMENTS[name]


def reproduce(name: str, out_dir: str | os.PathLike[str], *, quick: bool = False,
              progress: bool = True, **kwargs: Any) -> dict[str, Any]:
    """Run the experiment ``name`` (its ``--quick`` subset with ``quick``) into ``out_dir``."""
    experiment = get_experiment(name)
    if isinstance(experiment, CustomExperiment):
        from pathlib import Path

        if (kwargs.get("cells") is not None or kwargs.get("lrs") is not None
                or kwargs.get("report_only")):
            from fedax.experiments.config import ConfigError

            raise ConfigError(f"experiment {name} is not a table of cells: --cells, --lrs "
                              "and --report-only apply to the FedAvg-style tables only "
                              "(see --list)")

        command = kwargs.get("command") or f"fedax reproduce {name}" + " --quick" * quick
        return experiment.run(Path(out_dir), quick, progress, command)
    return reproduce_experiment(experiment, out_dir, quick=quick, progress=progress,
                                **kwargs)


__all__ = ["EXPERIMENTS", "Cell", "CustomExperiment", "Experiment", "cell_config",
           "get_experiment", "machine_info", "reproduce", "run_cell", "save_results"]
