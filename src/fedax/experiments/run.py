"""Build and run one experiment from a validated config; write its outputs.

Outputs in ``out_dir``: ``metrics.jsonl`` (one JSON object per evaluation), ``summary.json``
(config, seed, final accuracy, rounds to target, the server optimizer with every
hyperparameter and which are defaults) and ``accuracy.png``; with
``checkpoint_every > 0``, ``checkpoints/ckpt_<round>.msgpack`` (the last two), from which
``resume=True`` continues: ``metrics.jsonl`` then ends up as an uninterrupted run's.

Nothing is lost on the way: a run touches no earlier output until its first evaluation (so
a refused resume or a failed start leaves the directory as it was), ``summary.json``,
``accuracy.png`` and every rewrite of ``metrics.jsonl`` are written atomically, and the
JSON is strict: a non-finite number is written as ``null`` and marks its record (and the
summary) ``"status": "diverged"``; other records say ``"status": "ok"``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optax

from fedax import data as fdata
from fedax.algorithms import ALGORITHMS, FederatedAlgorithm
from fedax.algorithms import make as make_algorithm
from fedax.client import Batches
from fedax.experiments.config import (
    Config,
    ConfigError,
    ShakespeareConfig,
    SyntheticConfig,
    check_against_data,
    config_to_dict,
    resolved_server_optimizer,
    validate_config,
)
from fedax.experiments.privacy_plan import PrivacyPlan, compressor, privacy_plan
from fedax.models import get_model, softmax_cross_entropy, with_precision
from fedax.simulation import (
    Execution,
    History,
    choose_execution,
    make_evaluator,
    rounds_to_target,
    run,
)
from fedax.simulation.evaluation import client_index, make_client_evaluator
from fedax.simulation.host import cpu_dots_for, cpu_has_bf16, preferred_cpu_dots
from fedax.simulation.sources import HoldoutSource, PartitionSource

# A directory holding any of these holds a run (``checkpoints`` is a directory).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints")

def _check_precision_hardware(precision: str) -> None:
    """Warn where ``precision: bfloat16`` runs on a CPU: the numbers are bfloat16 compute's
    either way, but XLA:CPU ran it slower than float32 here, even with AMX-BF16
    (``benchmarks/bench_precision.py``); it pays on GPUs."""
    import jax

    if jax.default_backend() == "cpu":
        has = "with" if cpu_has_bf16() else "without"
        warnings.warn(f"precision: {precision} on a CPU ({has} bfloat16 arithmetic): XLA:CPU "
                      "ran the MNIST CNN and the char-LSTM slower than float32 "
                      "(benchmarks/bench_precision.py); it pays on GPUs. Drop the key for "
                      "float32", RuntimeWarning, stacklevel=2)



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


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def build_algorithm(config: Config, apply_fn, *, sequence: bool = False,
                    num_clients: int | None = None, aggregator: Any = None,
                    example_privacy: tuple[float, float] | None = None,
                    holdout_privacy: Any = None) -> FederatedAlgorithm:
    """The config's algorithm on ``apply_fn``'s model with the cross-entropy loss (per token,
    PAD targets ignored, when ``sequence``), with ``aggregator`` (default: the weighted
    mean). With ``server.lr: learned``, ``holdout_privacy`` (a ``HoldoutPrivacy``, from the
    run's privacy plan) privatizes the holdout hypergradient."""

    def loss_fn(params, batch: Batches):
        logits = apply_fn(params, batch.x)
        if sequence:
            from fedax.models.losses import token_cross_entropy

            return token_cross_entropy(logits, batch.y, batch.mask)
        return softmax_cross_entropy(logits, batch.y, batch.mask)

    # The registry entry's own options the config has (FedProx's mu), and its server
    # optimizer, every hyperparameter resolved (as summary.json records it).
    options = {k: getattr(config, k) for k in ALGORITHMS[config.algorithm].options
               if k in Config.model_fields}
    server = resolved_server_optimizer(config)
    hyperparameters = dict(server.hyperparameters)
    code = compressor(config)
    if code is not None and aggregator is None:  # (a DP plan's aggregator compresses itself)
        from fedax.aggregators import compressed

        aggregator = compressed(code)
    elif code is not None and (config.privacy is None or config.privacy.level != "user"):
        raise ConfigError("config key 'compression': cannot compress under the given "
                          "aggregator (compression builds its own; with DP, privacy.mechanism "
                          "gaussian); drop one of the two")
    algorithm = make_algorithm(config.algorithm, loss_fn,
                               num_clients=num_clients or config.num_clients,
                               client_lr=config.client_lr, server_optimizer=server.name,
                               server_lr=hyperparameters.pop("lr"), **hyperparameters,
                               aggregator=aggregator, example_privacy=example_privacy,
                               **options)
    if code is not None and config.compression.error_feedback:
        from fedax.algorithms.error_feedback import error_feedback

        algorithm = error_feedback(algorithm, code, num_clients or config.num_clients)
    if config.server.lr != "learned":
        return algorithm
    # η lives in the server optimizer's state; it is learned on holdout clients' loss.
    from fedax.hyper import learned_server_lr_in_state, private_learned_server_lr

    if holdout_privacy is not None:
        return private_learned_server_lr(
            algorithm, server.hyperparameters["lr"], loss_fn, holdout_privacy,
            optax.adam(config.learned_lr.hyper_lr), config.learned_lr.mode)
    if config.privacy is not None:
        raise ConfigError("config key 'server.lr': 'learned' with privacy needs the plan's "
                          "holdout privacy (fedax.experiments.privacy_plan)")

    return learned_server_lr_in_state(
        algorithm, server.hyperparameters["lr"], loss_fn,
        optax.adam(config.learned_lr.hyper_lr), config.learned_lr.mode)


def strict_json(value: Any) -> tuple[Any, bool]:
    """``value`` with every non-finite float (NaN, inf) replaced by None, and whether there
    was one; dicts, lists and tuples are walked."""
    if isinstance(value, (float, np.floating)):
        return (float(value), False) if math.isfinite(value) else (None, True)
    if isinstance(value, dict):
        items = {k: strict_json(v) for k, v in value.items()}
        return {k: v for k, (v, _) in items.items()}, any(bad for _, bad in items.values())
    if isinstance(value, (list, tuple)):
        items = [strict_json(v) for v in value]
        return [v for v, _ in items], any(bad for _, bad in items)
    return value, False


def with_status(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as strict JSON data with a ``status``: "diverged" when a value is not
    finite (it becomes null), else "ok" (a status already "diverged" stays so)."""
    clean, bad = strict_json(record)
    diverged = bad or record.get("status") == "diverged"
    return {**clean, "status": "diverged" if diverged else "ok"}


def dumps(value: Any, **kwargs: Any) -> str:
    """JSON text of ``value``; a non-finite float raises (sanitize with ``with_status``)."""
    return json.dumps(value, allow_nan=False, **kwargs)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Writes ``path`` as a whole or not at all: a temporary file in the same directory,
    fsynced, then renamed over ``path``. An OSError names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def accuracy_figure(curves: dict[str, History], target: float | None = None,
                    title: str | None = None):
    """The matplotlib figure of test accuracy against communication rounds, one line per
    run: every point shows (the y-axis runs from below the lowest point and the target up
    to 1), rounds are integers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    lows = [] if target is None else [target]
    for label, history in curves.items():
        points = [(r["round"], r["test_accuracy"]) for r in history.records
                  if isinstance(r.get("test_accuracy"), (int, float))
                  and math.isfinite(r["test_accuracy"])]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label,
                marker="." if len(points) < 30 else None)
        lows += [p[1] for p in points]
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("test accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if lows:
        lo = min(lows)
        ax.set_ylim(max(0.0, lo - max(0.02, 0.05 * (1.0 - lo))), 1.0)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def client_distribution_figure(records: list[dict[str, Any]], target: float | None = None,
                               title: str | None = None):
    """The clients' test accuracy over rounds (``per_client_eval`` records): the median,
    the 25-75 and 10-90 percentile bands, the mean of the worst 10% of clients, and the
    global accuracy; every evaluation is a point, rounds are integers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in records if all(isinstance(r.get(f"client_accuracy_{k}"), (int, float))
                                      for k in ("p10", "p25", "p50", "p75", "p90", "worst10"))]
    rounds = [r["round"] for r in rows]

    def column(key):
        return [r.get(key) if isinstance(r.get(key), (int, float)) else math.nan for r in rows]

    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.fill_between(rounds, column("client_accuracy_p10"), column("client_accuracy_p90"),
                    alpha=0.15, color="C0", label="clients, 10th-90th percentile")
    ax.fill_between(rounds, column("client_accuracy_p25"), column("client_accuracy_p75"),
                    alpha=0.3, color="C0", label="clients, 25th-75th percentile")
    marker = "." if len(rows) < 30 else None
    ax.plot(rounds, column("client_accuracy_p50"), color="C0", marker=marker,
            label="median client")
    ax.plot(rounds, column("client_accuracy_worst10"), color="C3", marker=marker,
            label="worst 10% of clients (mean)")
    ax.plot(rounds, column("test_accuracy"), color="k", linestyle="--", linewidth=1,
            label="global test accuracy")
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("test accuracy on the client's own data")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(max(0.0, min(column("client_accuracy_p10") + [1.0]) - 0.05), 1.0)
    ax.set_title(title or "per-client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    return fig


def plot_client_distribution(records: list[dict[str, Any]], path: Path,
                             target: float | None = None, title: str | None = None) -> None:
    """Writes ``client_distribution_figure(records, target, title)`` as a PNG, atomically."""
    save_figure(client_distribution_figure(records, target, title), path)


def save_figure(fig, path: Path) -> None:
    """Writes a matplotlib figure as a PNG (120 dpi), atomically, and closes it."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=120)
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())


def plot_curves(curves: dict[str, History], path: Path, target: float | None = None,
                title: str | None = None) -> None:
    """Writes ``accuracy_figure(curves, target, title)`` as a PNG, atomically."""
    import io

    import matplotlib.pyplot as plt

    fig = accuracy_figure(curves, target, title)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=120)
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())


class JsonlWriter:
    """Callback: append each evaluation record (as ``with_status``) to a JSON-lines file.

    Nothing is written until the run has a record: ``on_resume`` (a resumed run) rewrites
    the file with the checkpoint's records, else the first record replaces the file, after
    ``on_start()`` (e.g. removing a replaced run's stale outputs). ``records`` are the
    records so far, restored ones included."""

    def __init__(self, path: Path, on_start: Callable[[], None] | None = None):
        self.path = Path(path)
        self.on_start = on_start
        self.records: list[dict[str, Any]] = []
        self.started = False

    def start(self, first: str = "") -> None:
        """Begin the file (once): ``on_start()``, then the file holds ``first`` only."""
        if not self.started:
            if self.on_start is not None:
                self.on_start()
            write_atomic(self.path, first)
            self.started = True

    def __call__(self, record: dict[str, Any]) -> None:
        line = dumps(with_status(record)) + "\n"
        if not self.started:
            self.start(line)
        else:
            try:
                with self.path.open("a") as f:
                    f.write(line)
            except OSError as err:
                raise OSError(err.errno, err.strerror, str(self.path)) from err
        self.records.append(record)

    def on_resume(self, records: list[dict[str, Any]]) -> None:
        """Rewrite the file with the checkpoint's records (drops rounds to be recomputed)."""
        write_atomic(self.path, "".join(dumps(with_status(r)) + "\n" for r in records))
        self.records = list(records)
        self.started = True


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a run's outputs (metrics, summary or checkpoints)."""
    return any((Path(path) / name).exists() for name in RUN_OUTPUTS)


def new_run_dir(parent: Path, name: str, now: float | None = None) -> Path:
    """Creates and returns ``parent/<name>-<YYYYmmdd-HHMMSS>``, or with a suffix ``-2``,
    ``-3``, ... when that is taken (by another run, even one starting at the same time)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    Path(parent).mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = Path(parent) / (f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free run directory name for {name}-{stamp} in {parent}")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def finished_summary(out: Path, config: Config) -> dict[str, Any] | None:
    """The summary of the finished run of ``config`` in ``out`` (its ``summary.json`` holds
    the same config, keys added since at their defaults aside, and its records are there),
    else None."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
        saved = config_to_dict(validate_config(summary["config"]))
    except (OSError, ValueError, KeyError, TypeError):  # ConfigError is a ValueError
        return None
    if saved != config_to_dict(config) or not (Path(out) / "metrics.jsonl").is_file():
        return None
    return summary


class FederatedData(NamedTuple):
    """What a run needs from its data set: the clients' training data, a pooled test set,
    and the keyword arguments the model needs to fit the data (e.g. a vocabulary size)."""

    train: fdata.ClientData
    x_test: np.ndarray
    y_test: np.ndarray
    model_kwargs: dict[str, Any]
    # [N_test] int: the client of each test example (-1: none), with per_client_eval
    test_clients: np.ndarray | None = None


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
    # Each client's test data: the test set dealt by the same partitioner (same seed).
    test_clients = None if not config.per_client_eval else client_index(
        partition(config, arrays["y_test"]), len(arrays["y_test"]))
    return FederatedData(train, arrays["x_test"], arrays["y_test"],
                         _linear_kwargs(config, arrays["x_train"], arrays["y_train"]),
                         test_clients)


def _synthetic_data(config: Config) -> FederatedData:
    """Synthetic(α, β) with ``num_clients`` devices (seeded by ``seed``); each device's 90/10
    train/test split, the test splits pooled into the test set."""
    options = config.synthetic
    train, test = fdata.synthetic(options.alpha, options.beta, config.num_clients,
                                  seed=config.seed, iid=options.iid)
    test_clients = None if not config.per_client_eval else client_index(
        [test.indices[a:b] for a, b in zip(test.offsets[:-1], test.offsets[1:], strict=True)],
        len(test.y))
    return FederatedData(train, test.x, test.y, _linear_kwargs(config, train.x, train.y),
                         test_clients)


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
    # Each role's own test lines (with partition: iid too: the roles' lines are theirs).
    test_clients = None if not config.per_client_eval else client_index(
        arrays["test_partition"], len(arrays["y_test"]))
    return FederatedData(train, arrays["x_test"], arrays["y_test"],
                         {"vocab_size": int(arrays["vocab_size"])}, test_clients)


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
               "stragglers": 0.0, "drop_stragglers": False, "max_rejected_fraction": 0.5,
               "per_client_eval": False, "precision": "float32"}


def _fingerprint(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config_to_dict(config).items()
            if k != "checkpoint_every" and not (k in _LATER_KEYS and v == _LATER_KEYS[k])}


def _config_items(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The config's items of a checkpoint's fingerprint, by dotted key (``privacy.clip``)."""
    return {k[len("config."):]: v for k, v in fingerprint.items()
            if str(k).startswith("config.")}


def _differ(saved: dict[str, Any], wanted: dict[str, Any], schedule: Any) -> list[str]:
    from fedax.simulation.checkpoint import fingerprint_differences

    def rest(items):
        return {k: v for k, v in items.items() if k not in schedule}

    return fingerprint_differences(rest(saved), rest(wanted))


def run_progress(config: Config, out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Where an unfinished run of ``config`` in ``out`` stands, read (never changed) from its
    newest readable checkpoint if ``config`` continues it (its fingerprint is ``config``'s,
    ``rounds`` aside when no more than ``config.rounds`` are done and no noise multiplier
    was calibrated to them): ``{"round", "records", "elapsed_s"}``, the records being those
    a resume continues from. None when ``out`` holds no such checkpoint (no run, another
    config's, or checkpoints off)."""
    from fedax.simulation import checkpoint as ckpt
    from fedax.simulation.runner import flat_items

    data = ckpt.newest_readable(Path(out) / "checkpoints")
    if data is None:
        return None
    calibrated = config.privacy is not None and config.privacy.noise_multiplier is None
    if _differ(_config_items(data["fingerprint"]), dict(flat_items(_fingerprint(config), "")),
               () if calibrated else ("rounds",)) or int(data["round"]) > config.rounds:
        return None
    return {"round": int(data["round"]), "records": list(data["history"]),
            "elapsed_s": float(data["elapsed_s"])}


def resume_schedule(config: Config, out: str | os.PathLike[str],
                    plan: PrivacyPlan | None = None,
                    plan_for: Callable[[Config], PrivacyPlan | None] | None = None,
                    ) -> tuple[str, ...]:
    """The config keys in which ``config`` may differ from the run it resumes in ``out``
    (the newest readable checkpoint's): its schedule. ``rounds`` may grow, the resumed run's
    records being those of an uninterrupted run of the new length; with the noise
    multiplier given, ``privacy.target_epsilon`` may change (with z fixed a budget only
    ends the run) and a z the run had calibrated may now be given
    (``privacy.noise_multiplier``). ``plan`` is ``config``'s privacy plan and
    ``plan_for(config)`` makes one (for the z a run calibrated).

    Raises:
      ResumeError: the checkpoint is of this run (its schedule aside), but the run cannot
        be continued to ``config``'s schedule: it has done more rounds than ``config`` (or
        its budget) allows, or its z was calibrated to another number of rounds. Its
        ``settings`` say under which values it can. Nothing has been changed.
    """
    from fedax.simulation import checkpoint as ckpt
    from fedax.simulation.runner import flat_items

    schedule = ["rounds"]
    data = ckpt.newest_readable(Path(out) / "checkpoints")
    if data is None:
        return tuple(schedule)
    saved = _config_items(data["fingerprint"])
    wanted = dict(flat_items(_fingerprint(config), ""))
    p = config.privacy
    old_rounds = saved.get("rounds")
    if p is not None and p.noise_multiplier is not None:
        schedule.append("privacy.target_epsilon")
        if saved.get("privacy.noise_multiplier", 0) is None and plan_for is not None \
                and isinstance(old_rounds, int):  # calibrated then, given now
            then = p.model_copy(update={"noise_multiplier": None,
                                        "target_epsilon": saved.get("privacy.target_epsilon")})
            old = plan_for(config.model_copy(update={"rounds": old_rounds, "privacy": then}))
            if old is not None and old.noise_multiplier == p.noise_multiplier:
                schedule.append("privacy.noise_multiplier")
    if _differ(saved, wanted, schedule):
        return tuple(schedule)  # another run's: the runner names the differences
    done = int(data["round"])
    if p is not None and p.noise_multiplier is None and old_rounds != config.rounds \
            and isinstance(old_rounds, int) and plan_for is not None:
        old = plan_for(config.model_copy(update={"rounds": old_rounds}))
        z = old.noise_multiplier
        allows = old.ledger.rounds_within(p.target_epsilon, max_rounds=max(config.rounds, 1))
        raise ckpt.ResumeError(
            f"its noise multiplier z = {z!r} was calibrated to rounds={old_rounds} "
            f"(privacy.target_epsilon={p.target_epsilon:g} without privacy.noise_multiplier), "
            f"and rounds={config.rounds} would change it; to extend the run, fix its z "
            f"(privacy.noise_multiplier={z!r}) and raise or drop the budget (at that z, "
            f"{p.target_epsilon:g} allows {allows} rounds)",
            settings=[f"privacy.noise_multiplier={z!r}", "privacy.target_epsilon=null"])
    if done > config.rounds:
        raise ckpt.ResumeError(f"it has done {done} rounds, more than rounds={config.rounds}",
                               settings=[f"rounds={max(done, old_rounds or 0)}"])
    if plan is not None and done > plan.rounds:
        raise ckpt.ResumeError(
            f"it has done {done} rounds, more than privacy.target_epsilon="
            f"{p.target_epsilon:g} allows at noise multiplier {plan.noise_multiplier:g} "
            f"({plan.rounds}); give a budget that allows them")
    return tuple(schedule)


class AttackPlan(NamedTuple):
    """``config.attack`` made concrete: the data the clients train on (the attackers' part
    corrupted for a data-level attack), the update-level adversary (or None), the
    attackers' population ids, and the backdoor's test set (triggered inputs, target
    labels) or None."""

    data: FederatedData
    adversary: Any
    attackers: np.ndarray
    backdoor: tuple[np.ndarray, np.ndarray] | None

    def summary(self) -> dict[str, Any]:
        return {"num_attackers": len(self.attackers),
                "attackers": [int(k) for k in self.attackers]}


def attack_plan(config: Config, data: FederatedData) -> AttackPlan | None:
    """The attack of ``config.attack`` on ``data`` (None without one); attackers are drawn
    with ``attack.seed`` (default: the run's seed)."""
    a = config.attack
    if a is None:
        return None
    import dataclasses

    from fedax import attacks

    train = data.train
    num = train.num_clients
    seed = config.seed if a.seed is None else a.seed
    bad = attacks.choose_attackers(num, float(a.fraction), seed)
    parts = [train.client_indices(k) for k in range(num)]
    adversary, backdoor = None, None
    if a.kind == "label_flip":
        classes = int(max(np.max(train.y), np.max(data.y_test))) + 1
        train = dataclasses.replace(train, y=attacks.flip_labels(train.y, parts, bad, classes))
    elif a.kind == "backdoor":
        target = 0 if a.target is None else a.target
        x, y = attacks.poison_backdoor(train.x, train.y, parts, bad, target,
                                       a.poison_fraction or 0.5, seed)
        train = dataclasses.replace(train, x=x, y=y)
        backdoor = attacks.backdoor_test_set(data.x_test, data.y_test, target)
        if a.scale is not None or a.project is not None:  # boosted (model replacement)
            adversary = attacks.scaled(bad, num, factor=a.scale, project=a.project)
    else:
        options = {"sign_flip": {}, "scaled": {"factor": a.scale, "project": a.project},
                   "gaussian": {"stddev": a.stddev}, "alie": {"z": a.z},
                   "ipm": {"epsilon": a.epsilon}}[a.kind]
        keep_none = {"factor", "project", "z"}  # None means the paper's default there
        adversary = attacks.UPDATE_ATTACKS[a.kind](
            bad, num, **{k: v for k, v in options.items() if v is not None or k in keep_none})
    return AttackPlan(data._replace(train=train), adversary, bad, backdoor)


def robust_aggregator(config: Config) -> Any:
    """The aggregator of ``config.robust`` (None without one: the weighted mean)."""
    if config.robust is None:
        return None
    from fedax import aggregators

    return aggregators.robust(config.robust.rule, clip=config.robust.clip,
                              **config.robust.options())


class RoundTally:
    """Sums of round metrics over the rounds a run goes through: ``on_round`` is a round
    callback; as an evaluation callback it records nothing, but its ``on_resume`` marks a
    resumed run, whose rounds before the checkpoint it has not seen (``total`` is then
    None)."""

    def __init__(self, names: tuple[str, ...]):
        self.sums: dict[str, Any] = dict.fromkeys(names)  # None: no round reported it
        self.resumed = False

    def __call__(self, record: dict[str, Any]) -> None:
        del record

    def on_resume(self, records: list[dict[str, Any]]) -> None:
        del records
        self.resumed = True

    def on_round(self, number: int, metrics: dict[str, Any], data: Any) -> None:
        del number, data
        for name in self.sums:
            if name in metrics:
                self.sums[name] = (self.sums[name] or 0) + np.asarray(metrics[name]).item()

    def total(self, name: str) -> Any:
        """The sum of ``name`` over every round of the run (None: resumed, or not
        reported)."""
        return None if self.resumed else self.sums[name]


_TALLIED = ("uplink_bytes", "attackers_in_cohort", "attackers_selected")


def compression_summary(config: Config, params: Any, tally: RoundTally) -> dict[str, Any]:
    """``summary.json``'s ``compression``: the scheme, one client's message (its codes,
    and with its ``float32`` weight, as each round's ``uplink_bytes`` counts it per accepted
    client), the uncompressed message (the ``float32`` update and the weight), their ratio,
    and the uplink of every round run."""
    from fedax.aggregators.compression import uplink_sizes

    code = compressor(config)
    sizes = uplink_sizes(code, params)
    return {"scheme": config.compression.scheme, "compressor": code.name,
            "code_bytes_per_client": sizes.code_bytes,
            "bytes_per_client": sizes.client_bytes,
            "uncompressed_bytes_per_client": sizes.uncompressed_bytes,
            "compression_ratio": sizes.ratio,
            # null for a resumed run (the rounds before its checkpoint are not counted)
            "uplink_bytes_total": tally.total("uplink_bytes")}


def feature_summaries(config: Config, params: Any, attack: AttackPlan | None,
                      tally: RoundTally) -> dict[str, Any]:
    """The ``attack`` and ``compression`` entries of ``summary.json`` (those the config
    has): the attackers, and over the rounds run the attackers' accepted messages
    (``attackers_in_cohort_total``) and those Krum selected; the compression's sizes."""
    out: dict[str, Any] = {}
    if attack is not None:
        out["attack"] = {**attack.summary(),
                         "attackers_in_cohort_total": tally.total("attackers_in_cohort")}
        if tally.sums["attackers_selected"] is not None:
            out["attack"]["attackers_selected_total"] = tally.total("attackers_selected")
    if config.compression is not None:
        out["compression"] = compression_summary(config, params, tally)
    return out


def _with_backdoor(evaluate, backdoor):
    """``evaluate`` plus ``backdoor_success``: the accuracy on the triggered test inputs
    labelled with the target (the backdoor's success rate)."""

    def both(params):
        result = evaluate(params)
        if not isinstance(result, dict):
            result = {"test_accuracy": result[0], "test_loss": result[1]}
        return {**result, "backdoor_success": backdoor(params)[0]}

    return both


def run_experiment(
    config: Config,
    out_dir: str | Path,
    *,
    progress: bool = True,
    label: str | None = None,
    resume: bool = False,
    title: str | None = None,
    tensorboard: bool = True,
) -> dict[str, Any]:
    """Run ``config`` and write ``metrics.jsonl``, ``summary.json`` and ``accuracy.png``
    (with ``per_client_eval``, also ``client_accuracy.png``), and with ``tensorboard`` the
    TensorBoard event files of every record into ``tensorboard/``.

    With ``resume``, continue from the newest valid checkpoint in ``out_dir/checkpoints``
    (the config must be the same, ``checkpoint_every`` and the schedule of
    :func:`resume_schedule` aside: ``rounds`` may grow; else ``CheckpointError``, and
    nothing in ``out_dir`` has changed). A run that restores no checkpoint replaces the
    directory's earlier outputs at its first evaluation. A run that diverges still writes
    its summary (``"status": "diverged"``) and plot, then raises its ``FloatingPointError``.
    ``label`` names the curve (default: the algorithm), ``title`` the plot (default:
    ``label`` or the directory's name)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(config)
    attack = attack_plan(config, data)
    if attack is not None:
        data = attack.data
    train = data.train
    check_against_data(config, train.sizes)
    model = with_precision(get_model(config.model, **data.model_kwargs), config.precision)
    if config.precision != "float32":
        _check_precision_hardware(config.precision)
    import jax

    params = jax.jit(model.init)(jax.random.key(config.seed))
    plan = privacy_plan(config, train.num_clients, train.sizes)
    # What a resume may change (the schedule); raises, changing nothing, if it cannot.
    schedule = () if not resume else resume_schedule(
        config, out, plan, lambda c: privacy_plan(c, train.num_clients, train.sizes))
    algorithm = build_algorithm(config, model.apply, sequence=data.y_test.ndim > 1,
                                num_clients=train.num_clients,
                                aggregator=robust_aggregator(config) if plan is None
                                else plan.aggregator,
                                example_privacy=None if plan is None else plan.example_privacy,
                                holdout_privacy=None if plan is None else plan.holdout)
    if data.test_clients is not None:
        evaluate = make_client_evaluator(model.apply, data.x_test, data.y_test,
                                         data.test_clients, target=config.target_accuracy,
                                         num_clients=train.num_clients)
    else:
        evaluate = make_evaluator(model.apply, data.x_test, data.y_test)
    if attack is not None:
        from fedax.attacks import attacked

        algorithm = attacked(algorithm, attack.adversary, train.num_clients,
                             attackers=attack.attackers)
        if attack.backdoor is not None:
            evaluate = _with_backdoor(evaluate, make_evaluator(model.apply, *attack.backdoor))
    execution: Execution = choose_execution(
        config.execution.strategy, config.execution.local_steps, config.execution.devices,
        params=params,
    )

    def replace_earlier_outputs() -> None:
        for name in ("summary.json", "accuracy.png", "client_accuracy.png"):
            (out / name).unlink(missing_ok=True)
        if not config.checkpoint_every:  # else the runner has already replaced them
            from fedax.simulation.checkpoint import remove_checkpoints

            remove_checkpoints(out / "checkpoints")

    writer = JsonlWriter(out / "metrics.jsonl", on_start=replace_earlier_outputs)
    callbacks: list[Any] = [writer]
    round_callbacks: list[Any] = []
    if tensorboard:  # after the writer: its on_start replaces earlier outputs first
        from fedax.simulation.tensorboard import TensorBoardLogger

        board = TensorBoardLogger(out / "tensorboard")
        callbacks.append(board)
        round_callbacks.append(board.on_round)
    tally = RoundTally(_TALLIED)  # the summary's totals over every round
    callbacks.append(tally)
    round_callbacks.append(tally.on_round)
    label = label or config.algorithm
    title = title or label or out.name
    started = time.perf_counter()
    source = PartitionSource(train, config.client_fraction, config.local_epochs,
                             config.batch_size, config.seed, config.stragglers,
                             config.drop_stragglers,
                             sampling="fixed" if plan is None else config.privacy.sampling)
    if config.server.lr == "learned":
        cohort_size = len(fdata.sample_clients(0, train.num_clients, config.client_fraction))
        source = HoldoutSource(source, config.learned_lr.holdout_clients or cohort_size)
    try:
        with preferred_cpu_dots(cpu_dots_for(config.model, config.precision)):
            history = run(
                algorithm,
                params,
                source,
                evaluate,
                # A privacy budget ends the run before the round that would exceed it.
                rounds=config.rounds if plan is None else plan.rounds,
                seed=config.seed,
                eval_every=config.eval_every,
                target_accuracy=config.target_accuracy,
                stop_at_target=config.stop_at_target,
                execution=execution,
                callbacks=callbacks,
                round_callbacks=round_callbacks,
                progress=progress,
                checkpoint_dir=out / "checkpoints",
                checkpoint_every=config.checkpoint_every,
                resume=resume,
                # The algorithm, model and data choices the runner cannot see. How often to save
                # does not change the run, so a resumed run may save more or less often.
                fingerprint=_fingerprint(config),
                schedule=schedule,
                record_fields=None if plan is None else (lambda t: {"epsilon": plan.epsilon(t)}),
                max_rejected_fraction=config.max_rejected_fraction,
            )
    except FloatingPointError as err:
        writer.start()
        summary = summarize(config, writer.records, time.perf_counter() - started, execution,
                            plan=plan)
        summary.update(status="diverged", diverged_at_round=getattr(err, "round", None),
                       error=str(err))
        summary.update(feature_summaries(config, params, attack, tally))
        write_outputs(out, summary, writer.records, label, title)
        raise
    finally:
        for callback in callbacks:
            getattr(callback, "close", lambda: None)()
    summary = summarize(config, history.records, time.perf_counter() - started, execution,
                        resumed_from=history.resumed_from, plan=plan)
    summary.update(feature_summaries(config, params, attack, tally))
    write_outputs(out, summary, history.records, label, title)
    return summary


def summarize(config: Config, records: list[dict[str, Any]], wall: float, execution: Execution,
              resumed_from: int | None = None, plan: PrivacyPlan | None = None
              ) -> dict[str, Any]:
    """The ``summary.json`` of a run with these evaluation records (possibly none)."""
    history = History([r for r in records if isinstance(r.get("test_accuracy"), (int, float))
                       and math.isfinite(r["test_accuracy"])])
    accs = history.column("test_accuracy")
    target = config.target_accuracy
    reached = history.rounds_to_target(target) if target is not None and accs else None
    per_client = {}
    worst = [r for r in history.records if isinstance(r.get("client_accuracy_worst10"), float)]
    if worst:  # per_client_eval: the target read on the worst decile's curve too
        worst_reached = None if target is None else rounds_to_target(
            [r["round"] for r in worst], [r["client_accuracy_worst10"] for r in worst], target)
        per_client = {
            "final_client_accuracy": {k: v for k, v in worst[-1].items()
                                      if k.startswith("client_accuracy")},
            "rounds_to_target_worst10": None if worst_reached is None
                                        else round(worst_reached, 1)}
    rounds_run = records[-1]["round"] if records else 0
    status = "diverged" if any(with_status(r)["status"] == "diverged" for r in records) \
        else "ok"
    stop = None if plan is None else plan.budget_line(config, rounds_run)
    if stop is not None and status == "ok":
        status = "stopped_by_budget"
    return {
        "config": config_to_dict(config),
        "seed": config.seed,
        # "ok", "diverged", or "stopped_by_budget" (privacy.target_epsilon ended the run
        # before config.rounds; stop_reason says when and why)
        "status": status,
        "stop_reason": stop,
        "rounds_run": rounds_run,
        "final_test_accuracy": records[-1]["test_accuracy"] if records else None,
        "best_test_accuracy": max(accs) if accs else None,
        "target_accuracy": target,
        "rounds_to_target": None if reached is None else round(reached, 1),
        "wall_time_s": round(wall, 2),
        "execution": execution._asdict(),
        # name, every hyperparameter, which are defaults (not in the config), the paper
        "server_optimizer": _server_summary(config),
        # the last record: every metric of the last evaluated round (the algorithm's and its
        # aggregator's, a learned η)
        "last_record": records[-1] if records else None,
        "resumed_from_round": resumed_from,
        # ε spent by the rounds run, z, q, the accountant and sampling it assumes
        "privacy": None if plan is None else plan.summary(
            config, rounds_run, records[-1] if records else None),
        **per_client,
    }


def _server_summary(config: Config) -> dict[str, Any]:
    summary = resolved_server_optimizer(config).as_dict()
    if config.server.lr == "learned":  # lr is the initial η; the records hold each round's
        summary["learned_lr"] = config.learned_lr.model_dump()
    return summary


def write_outputs(out: Path, summary: dict[str, Any], records: list[dict[str, Any]],
                  label: str, title: str) -> None:
    """``summary.json`` (strict JSON, a non-finite value null and the status "diverged")
    and ``accuracy.png``, each written atomically."""
    clean, bad = strict_json(summary)
    if bad:
        clean["status"] = "diverged"
    write_atomic(out / "summary.json", dumps(clean, indent=2) + "\n")
    if records:
        plot_curves({label: History(list(records))}, out / "accuracy.png",
                    summary["target_accuracy"], title=title)
    if any("client_accuracy_p10" in r for r in records):
        plot_client_distribution(records, out / "client_accuracy.png",
                                 summary["target_accuracy"], title=f"{title}: per client")


def fmt_rounds(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.0f}"
