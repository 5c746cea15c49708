"""Build and run one experiment from a validated config; write its outputs.

Outputs in ``out_dir``: ``metrics.jsonl`` (one JSON object per evaluation), ``summary.json``
(config, seed, final accuracy, rounds to target) and ``accuracy.png``; with
``checkpoint_every > 0``, ``checkpoints/ckpt_<round>.msgpack`` (the last two), from which
``resume=True`` continues: ``metrics.jsonl`` then ends up as an uninterrupted run's.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optax

from fedax import data as fdata
from fedax.algorithms import FederatedAlgorithm
from fedax.algorithms import make as make_algorithm
from fedax.cli.config import (
    Config,
    ShakespeareConfig,
    SyntheticConfig,
    check_against_data,
    config_to_dict,
)
from fedax.client import Batches
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import Execution, History, choose_execution, make_evaluator, run

_DATASETS: dict[str, Any] = {}


def load_dataset(name: str) -> dict[str, np.ndarray]:
    """The named data set as NumPy arrays (cached in-process)."""
    loaders = {"mnist": fdata.load_mnist, "fashion_mnist": fdata.load_fashion_mnist}
    if name not in _DATASETS:
        if name not in loaders:
            raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(loaders)}")
        _DATASETS[name] = loaders[name]()
    return _DATASETS[name]


def partition(config: Config, y: np.ndarray) -> list[np.ndarray]:
    if config.partition == "iid":
        return fdata.iid(len(y), config.num_clients, config.seed)
    if config.partition == "pathological":
        return fdata.pathological(y, config.num_clients, 2, seed=config.seed)
    if config.partition == "dirichlet":
        return fdata.dirichlet(y, config.num_clients, config.dirichlet_alpha, config.seed)
    if config.partition == "similarity":
        return fdata.similarity(y, config.num_clients, config.similarity, config.seed)
    return fdata.unbalanced(len(y), config.num_clients, config.seed)


def server_optimizer(config: Config) -> optax.GradientTransformation:
    server = config.server
    if server.optimizer == "sgd":
        return optax.sgd(server.lr)
    if server.optimizer == "momentum":
        return optax.sgd(server.lr, momentum=server.momentum)
    return optax.adam(server.lr)


def build_algorithm(config: Config, apply_fn, *, sequence: bool = False,
                    num_clients: int | None = None) -> FederatedAlgorithm:
    """The config's algorithm on ``apply_fn``'s model with the cross-entropy loss (per token,
    PAD targets ignored, when ``sequence``)."""

    def loss_fn(params, batch: Batches):
        logits = apply_fn(params, batch.x)
        if sequence:
            from fedax.models.losses import token_cross_entropy

            return token_cross_entropy(logits, batch.y, batch.mask)
        return softmax_cross_entropy(logits, batch.y, batch.mask)

    name, server = config.algorithm, config.server
    if name in ("fedadam", "fedyogi", "fedamsgrad"):
        options = dict(server_lr=server.lr, b1=server.b1, b2=server.b2, tau=server.tau)
    elif name == "fedadagrad":
        options = dict(server_lr=server.lr, tau=server.tau)
    elif name == "fedavgm":
        options = dict(server_lr=server.lr, momentum=server.momentum)
    else:
        options = dict(server_optimizer=server_optimizer(config))
        if name == "fedprox":
            options["mu"] = config.mu
    return make_algorithm(name, loss_fn, num_clients=num_clients or config.num_clients,
                          client_lr=config.client_lr, **options)


def plot_curves(curves: dict[str, History], path: Path, target: float | None = None) -> None:
    """Test accuracy against communication rounds, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, history in curves.items():
        ax.plot(history.column("round"), history.column("test_accuracy"), label=label)
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("test accuracy")
    accs = [a for h in curves.values() for a in h.column("test_accuracy")]
    if accs:
        lo = float(np.percentile(accs, 5))
        ax.set_ylim(max(0.0, min(lo, (target or 1.0) - 0.05)), 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class JsonlWriter:
    """Callback: append each evaluation record to a JSON-lines file."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def __call__(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_resume(self, records: list[dict[str, Any]]) -> None:
        """Rewrite the file with the checkpoint's records (drops rounds to be recomputed)."""
        self.path.write_text("".join(json.dumps(r) + "\n" for r in records))


class FederatedData(NamedTuple):
    """What a run needs from its data set: the clients' training data, a pooled test set,
    and the keyword arguments the model needs to fit the data (e.g. a vocabulary size)."""

    train: fdata.ClientData
    x_test: np.ndarray
    y_test: np.ndarray
    model_kwargs: dict[str, Any]


def _linear_kwargs(config: Config, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """``model: logistic`` takes its input size and class count from the data."""
    if config.model != "logistic":
        return {}
    return {"input_dim": int(np.prod(x.shape[1:])), "num_classes": int(y.max()) + 1}


def _image_data(config: Config) -> FederatedData:
    arrays = load_dataset(config.dataset)
    train = fdata.ClientData.from_partition(
        arrays["x_train"], arrays["y_train"], partition(config, arrays["y_train"])
    )
    return FederatedData(train, arrays["x_test"], arrays["y_test"],
                         _linear_kwargs(config, arrays["x_train"], arrays["y_train"]))


def _synthetic_data(config: Config) -> FederatedData:
    """Synthetic(α, β) with ``num_clients`` devices (seeded by ``seed``); each device's 90/10
    train/test split, the test splits pooled into the test set."""
    options = config.synthetic
    train, test = fdata.synthetic(options.alpha, options.beta, config.num_clients,
                                  seed=config.seed, iid=options.iid)
    return FederatedData(train, test.x, test.y, _linear_kwargs(config, train.x, train.y))


# The parsed data of the last options used (a reproduction runs many cells on the same data).
_load_shakespeare = functools.lru_cache(maxsize=1)(fdata.load_shakespeare)


def _shakespeare_data(config: Config) -> FederatedData:
    """Shakespeare by role (``partition: natural``) or its balanced IID variant, the test
    lines of every role pooled into the test set; next-character prediction."""
    options = config.shakespeare
    arrays = _load_shakespeare(
        iid=config.partition == "iid", seq_len=options.seq_len,
        max_clients=options.max_clients, sample=options.sample, seed=config.seed)
    train = fdata.ClientData.from_partition(arrays["x_train"], arrays["y_train"],
                                            arrays["train_partition"])
    return FederatedData(train, arrays["x_test"], arrays["y_test"],
                         {"vocab_size": int(arrays["vocab_size"])})


# config.dataset -> builder. A data set whose labels are [N, T] (sequences) is trained and
# evaluated per token, PAD (id 0) targets ignored.
DATA_BUILDERS: dict[str, Callable[[Config], FederatedData]] = {
    "mnist": _image_data,
    "fashion_mnist": _image_data,
    "synthetic": _synthetic_data,
    "shakespeare": _shakespeare_data,
}


def build_data(config: Config) -> FederatedData:
    if config.dataset not in DATA_BUILDERS:
        raise ValueError(f"unknown dataset {config.dataset!r}; "
                         f"allowed: {', '.join(DATA_BUILDERS)}")
    return DATA_BUILDERS[config.dataset](config)


# Keys added after checkpoints existed: left out of the fingerprint at their defaults, so
# those checkpoints still resume.
_LATER_KEYS = {"synthetic": SyntheticConfig().model_dump(mode="json"),
               "shakespeare": ShakespeareConfig().model_dump(mode="json"),
               "stragglers": 0.0, "drop_stragglers": False}


def _fingerprint(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config_to_dict(config).items()
            if k != "checkpoint_every" and not (k in _LATER_KEYS and v == _LATER_KEYS[k])}


def run_experiment(
    config: Config,
    out_dir: str | Path,
    *,
    progress: bool = True,
    label: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run ``config`` and write ``metrics.jsonl``, ``summary.json`` and ``accuracy.png``.

    With ``resume``, continue from the newest valid checkpoint in ``out_dir/checkpoints``
    (the config must be the same, ``checkpoint_every`` aside; else ``ConfigError``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(config)
    train = data.train
    check_against_data(config, train.sizes)
    model = get_model(config.model, **data.model_kwargs)
    import jax

    params = jax.jit(model.init)(jax.random.key(config.seed))
    algorithm = build_algorithm(config, model.apply, sequence=data.y_test.ndim > 1,
                                num_clients=train.num_clients)
    evaluate = make_evaluator(model.apply, data.x_test, data.y_test)
    execution: Execution = choose_execution(
        config.execution.strategy, config.execution.local_steps, config.execution.devices,
        params=params,
    )
    started = time.perf_counter()
    history = run(
        algorithm,
        params,
        train,
        evaluate,
        rounds=config.rounds,
        client_fraction=config.client_fraction,
        local_epochs=config.local_epochs,
        batch_size=config.batch_size,
        seed=config.seed,
        eval_every=config.eval_every,
        target_accuracy=config.target_accuracy,
        stop_at_target=config.stop_at_target,
        execution=execution,
        callbacks=[JsonlWriter(out / "metrics.jsonl")],
        progress=progress,
        checkpoint_dir=out / "checkpoints",
        checkpoint_every=config.checkpoint_every,
        resume=resume,
        # The algorithm, model and data choices the runner cannot see. How often to save
        # does not change the run, so a resumed run may save more or less often.
        fingerprint=_fingerprint(config),
        straggler_fraction=config.stragglers,
        drop_stragglers=config.drop_stragglers,
    )
    wall = time.perf_counter() - started
    target = config.target_accuracy
    reached = history.rounds_to_target(target) if target is not None else None
    last = history.records[-1]
    summary = {
        "config": config_to_dict(config),
        "seed": config.seed,
        "rounds_run": last["round"],
        "final_test_accuracy": last["test_accuracy"],
        "best_test_accuracy": max(history.column("test_accuracy")),
        "target_accuracy": target,
        "rounds_to_target": None if reached is None else round(reached, 1),
        "wall_time_s": round(wall, 2),
        "execution": execution._asdict(),
        "resumed_from_round": history.resumed_from,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_curves({label or config.algorithm: history}, out / "accuracy.png", target)
    return summary


def fmt_rounds(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.0f}"
