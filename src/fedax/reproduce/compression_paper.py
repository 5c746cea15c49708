"""``fedax reproduce compression``: accuracy against uplink bits on MNIST 2NN, per scheme.

Every run is an ordinary config run (``fedax.experiments.run``) with a ``compression:``
section: FedAvg on MNIST (IID, 100 clients × 600, C = 0.1, E = 1, B = 50, client SGD, server
step 1) with each client's update sent through a compressor (``fedax.aggregators
.compression``): QSGD (Alistarh et al.) at s levels, Suresh et al.'s randomized Hadamard
rotation + b-bit stochastic quantization, top-k with and without error feedback (Stich et
al.; Karimireddy et al.), 16-bit casts and per-bucket int8, against the uncompressed float32
update. Per scheme: bits per coordinate of the uplink (the encoded message's bytes, as
``comm_cost`` prices them, over the model's 199,210 coordinates), accuracy (the mean of the
last evaluations), rounds to the target accuracy and the total uplink bytes to reach it
(rounds × clients a round × bytes a message).

The qualitative claims checked (docs/references.md, compressed communication: no
bits-vs-accuracy table of the papers was read, so the claims are the abstracts'): unbiased
quantization at a few bits a coordinate
(QSGD at 4 bits, rotation at 2-4 bits) matches uncompressed accuracy; 16-bit casts cost
nothing; top-k without error feedback loses accuracy and error feedback recovers it; and,
in Suresh et al.'s own setting (distributed mean estimation, ``mean_estimation``), the
random rotation lowers the error of the mean at the same bits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedax.reproduce.custom import results_header, run_config, runs_experiment
from fedax.reproduce.framework import CustomExperiment, Experiment, save_results
from fedax.reproduce.report import notes_sections, paragraph, pyplot, save_png, save_report

PAPERS = ("Alistarh, Grubic, Li, Tomioka, Vojnovic, \"QSGD\", NeurIPS 2017; Suresh, Yu, "
          "Kumar, McMahan, \"Distributed Mean Estimation with Limited Communication\", ICML "
          "2017; Stich, Cordonnier, Jaggi, \"Sparsified SGD with Memory\", NeurIPS 2018; "
          "Karimireddy, Rebjock, Stich, Jaggi, \"Error Feedback Fixes SignSGD\", ICML 2019")
TITLE = "Compressed uplink on MNIST 2NN: accuracy against bits per coordinate and bytes"

BASE: dict[str, Any] = {
    "dataset": "mnist", "num_clients": 100, "partition": "iid", "model": "2nn",
    "algorithm": "fedavg", "client_fraction": 0.1, "local_epochs": 1, "batch_size": 50,
    "client_lr": 0.2, "execution": {"devices": 1},
}

# (label, compression section or None)
SCHEMES_QUICK: tuple[tuple[str, Mapping[str, Any] | None], ...] = (
    ("float32 (none)", None),
    ("float16", {"scheme": "float16"}),
    ("bfloat16", {"scheme": "bfloat16"}),
    ("int8", {"scheme": "int8"}),
    ("QSGD s=7", {"scheme": "qsgd", "levels": 7}),
    ("QSGD s=1", {"scheme": "qsgd", "levels": 1}),
    ("rotation b=4", {"scheme": "rotation", "bits": 4}),
    ("rotation b=2", {"scheme": "rotation", "bits": 2}),
    ("rotation b=1", {"scheme": "rotation", "bits": 1}),
    ("top-k 10%", {"scheme": "top_k", "fraction": 0.1}),
    ("top-k 10% + EF", {"scheme": "top_k", "fraction": 0.1, "error_feedback": True}),
    ("top-k 1%", {"scheme": "top_k", "fraction": 0.01}),
    ("top-k 1% + EF", {"scheme": "top_k", "fraction": 0.01, "error_feedback": True}),
)
SCHEMES_FULL = SCHEMES_QUICK + (
    ("QSGD s=3", {"scheme": "qsgd", "levels": 3}),
)
QUICK = dict(rounds=80, eval_every=5, last_k=4, seeds=(0,), target=0.95,
             schemes=SCHEMES_QUICK)
FULL = dict(rounds=200, eval_every=5, last_k=8, seeds=(0, 1, 2), target=0.97,
            schemes=SCHEMES_FULL)
MATCH = 0.01  # "matches uncompressed accuracy": within one accuracy point


def _experiment(settings: Mapping[str, Any]) -> Experiment:
    base = {**BASE, "rounds": settings["rounds"], "eval_every": settings["eval_every"],
            "target_accuracy": settings["target"]}
    return runs_experiment("compression", base, settings["last_k"], title=TITLE)


def _dirname(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-").replace(
        "--", "-")


def message_bytes(section: Mapping[str, Any] | None, seed: int = 0) -> int:
    """Bytes one client sends a round under ``section`` (None: the float32 update), its
    float32 weight included, for the 2NN."""
    import jax

    from fedax.aggregators.compression import make_compressor
    from fedax.aggregators.compression import message_bytes as code_bytes
    from fedax.models import get_model

    template = jax.eval_shape(get_model("2nn").init, jax.random.key(0))
    if section is None:
        return 4 * sum(math.prod(a.shape) for a in jax.tree.leaves(template)) + 4
    options = {k: v for k, v in section.items() if k not in ("scheme", "error_feedback")}
    return code_bytes(make_compressor(section["scheme"], seed=seed, **options), template) + 4


def _run_scheme(experiment: Experiment, label: str, section: Mapping[str, Any] | None,
                seeds: Sequence[int], out: Path, progress: bool,
                log: Callable[[str], None]) -> dict[str, Any]:
    per_seed = []
    for seed in seeds:
        config: dict[str, Any] = {"seed": seed}
        if section is not None:
            config["compression"] = dict(section)
        summary = run_config(experiment, _dirname(label), label, config,
                             out / "runs" / _dirname(label) / f"seed{seed}", progress=progress)
        per_seed.append({
            "seed": seed, "last_accuracy": summary["last_accuracy"],
            "final_test_accuracy": summary["final_test_accuracy"],
            "best_test_accuracy": summary["best_test_accuracy"],
            "rounds_to_target": summary.get("rounds_to_target"),
            "wall_time_s": summary["wall_time_s"], "reused": bool(summary.get("reused")),
            "records": [{"round": r["round"], "test_accuracy": r["test_accuracy"]}
                        for r in summary["records"]],
        })
        log(f"   {label:<16} seed {seed}: last-{experiment.last_k} acc "
            f"{summary['last_accuracy']:.4f}, rounds to target "
            f"{summary.get('rounds_to_target')}, {summary['wall_time_s']:.0f} s"
            + (" (reused)" if summary.get("reused") else ""))
    size = message_bytes(section)
    clients = round(experiment.base["client_fraction"] * experiment.base["num_clients"])
    reached = [s["rounds_to_target"] for s in per_seed]
    rounds = (sum(reached) / len(reached)) if all(r is not None for r in reached) else None
    return {
        "label": label, "compression": None if section is None else dict(section),
        "message_bytes": size,
        "bits_per_coordinate": 8 * size / 199_210,
        "accuracy": sum(s["last_accuracy"] for s in per_seed) / len(per_seed),
        "rounds_to_target": rounds,
        "uplink_bytes_to_target": None if rounds is None else rounds * clients * size,
        "wall_time_s": round(sum(s["wall_time_s"] for s in per_seed), 1),
        "per_seed": per_seed,
    }


def run_compression(out_dir: Path, quick: bool, progress: bool, command: str, *,
                    settings: Mapping[str, Any] | None = None,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``compression`` experiment (``settings`` lets a test run a tiny one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(settings or (QUICK if quick else FULL))
    started = time.perf_counter()
    experiment = _experiment(settings)
    rows = []
    for label, section in settings["schemes"]:
        log(f"== {label}: {len(settings['seeds'])} seed(s), {settings['rounds']} rounds")
        rows.append(_run_scheme(experiment, label, section, settings["seeds"], out, progress,
                                log))
    baseline = rows[0]
    for row in rows:
        row["minus_uncompressed"] = row["accuracy"] - baseline["accuracy"]
        row["compression_ratio"] = baseline["message_bytes"] / row["message_bytes"]
    results = {
        **results_header("compression", TITLE, PAPERS, quick=quick, command=command,
                         started=started),
        "settings": {k: ([list(x) for x in v] if k == "schemes" else
                         list(v) if isinstance(v, tuple) else v) for k, v in settings.items()},
        "base_config": experiment.base, "rows": rows,
    }
    results["mean_estimation"] = mean_estimation()
    results["wall_time_s"] = round(time.perf_counter() - started, 1)
    results["claims"] = claims(rows) + [{
        "claim": f"the random rotation lowers the error of the mean at {r['bits']} bit(s) "
                 "(Suresh et al.)",
        "held": bool(r["improvement"] > 1),
        "numbers": f"relative MSE {r['plain']:.3g} without, {r['rotated']:.3g} with "
                   f"({r['improvement']:.1f}× lower)"} for r in results["mean_estimation"]]
    results["figures"] = figures(results, out)
    write_report(results, out)
    save_results(results, out)
    return results


def mean_estimation(dim: int = 1 << 14, clients: int = 10, trials: int = 20,
                    bits: Sequence[int] = (1, 2, 4), seed: int = 0) -> list[dict[str, Any]]:
    """Suresh et al.'s distributed mean estimation: ``clients`` vectors of ``dim``
    coordinates (N(0, 1) with 8 coordinates ×30, a spiky vector), each quantized to b bits
    by ``compressed(rotation(b))`` with and without the rotation; the mean squared error of
    the server's mean over ``trials`` draws (fresh quantization and rotation keys), relative
    to ‖mean‖²."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedax.aggregators import aggregate, compressed, rotation

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(clients, dim)).astype(np.float32)
    x[:, :8] *= 30
    values = {"v": jnp.asarray(x)}
    truth = values["v"].mean(0)
    out = []
    for b in bits:
        row: dict[str, Any] = {"bits": b}
        for rotate in (False, True):
            agg = compressed(rotation(b, rotate=rotate))
            run = jax.jit(lambda k, s, agg=agg: aggregate(agg, values, jnp.ones(clients), s,
                                                          k)[0]["v"])
            errors = []
            for t in range(trials):
                shared = agg.init(values) if not rotate else jax.random.key_data(
                    jax.random.key(1000 + t))
                errors.append(float(jnp.sum((run(jax.random.key(t), shared) - truth) ** 2)))
            row["rotated" if rotate else "plain"] = float(np.mean(errors)) / float(
                jnp.sum(truth**2))
        row["improvement"] = row["plain"] / row["rotated"]
        out.append(row)
    return out


def _row(rows: Sequence[Mapping[str, Any]], label: str) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["label"] == label), None)


def claims(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each qualitative claim, whether it held here and the numbers it rests on."""
    base = rows[0]
    out = []

    def gap(label):
        row = _row(rows, label)
        return None if row is None else row["accuracy"] - base["accuracy"]

    for label, claim in (("float16", "16-bit casts cost no accuracy"),
                         ("bfloat16", "16-bit casts cost no accuracy"),
                         ("QSGD s=7", "QSGD at 4 bits a coordinate matches float32"),
                         ("rotation b=4", "rotation + 4-bit quantization matches float32"),
                         ("rotation b=2", "rotation + 2-bit quantization matches float32")):
        g = gap(label)
        if g is not None:
            out.append({"claim": f"{claim} ({label})", "held": bool(g >= -MATCH),
                        "numbers": f"{label} {_row(rows, label)['accuracy']:.4f} vs float32 "
                                   f"{base['accuracy']:.4f} ({g * 100:+.2f} points; "
                                   f"criterion: ≥ −{MATCH * 100:g} point)"})
    for frac in ("1%", "10%"):
        plain, ef = _row(rows, f"top-k {frac}"), _row(rows, f"top-k {frac} + EF")
        if plain is None or ef is None:
            continue
        out.append({
            "claim": f"top-k {frac} without error feedback loses accuracy (> {MATCH * 100:g} "
                     "point below float32)",
            "held": bool(plain["accuracy"] < base["accuracy"] - MATCH),
            "numbers": f"{plain['accuracy']:.4f} vs {base['accuracy']:.4f} "
                       f"({(plain['accuracy'] - base['accuracy']) * 100:+.2f} points)"})
        out.append({
            "claim": f"error feedback recovers top-k {frac} (better than without, within "
                     f"{MATCH * 100:g} point of float32)",
            "held": bool(ef["accuracy"] > plain["accuracy"]
                         and ef["accuracy"] >= base["accuracy"] - MATCH),
            "numbers": f"with EF {ef['accuracy']:.4f}, without {plain['accuracy']:.4f}, "
                       f"float32 {base['accuracy']:.4f}"})
    return out


def figures(results: dict[str, Any], out: Path) -> list[str]:
    """``accuracy_vs_bits.png``: accuracy against bits per coordinate, and against uplink
    bytes; returns the file names."""
    plt = pyplot()

    rows = results["rows"]
    clients = round(results["base_config"]["client_fraction"] *
                    results["base_config"]["num_clients"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax in (ax1, ax2):  # one colour per scheme
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for row in rows:
        ax1.scatter(row["bits_per_coordinate"], row["accuracy"], s=22)
        ax1.annotate(row["label"], (row["bits_per_coordinate"], row["accuracy"]), fontsize=7,
                     textcoords="offset points", xytext=(4, 2))
        seed = row["per_seed"][0]
        t = [r["round"] for r in seed["records"]]
        acc = [r["test_accuracy"] for r in seed["records"]]
        ax2.plot([x * clients * row["message_bytes"] for x in t], acc, linewidth=1.1,
                 label=row["label"])
    ax1.set_xscale("log", base=2)
    ax1.set(xlabel="uplink bits per coordinate (log₂)",
            ylabel=f"last-{results['settings']['last_k']} test accuracy",
            title="accuracy against bits per coordinate")
    target = results["settings"]["target"]
    ax2.axhline(target, color="gray", linestyle="--", linewidth=0.8)
    ax2.set_xscale("log")
    accs = [r["test_accuracy"] for row in rows for r in row["per_seed"][0]["records"]]
    ax2.set_ylim(max(0.0, sorted(accs)[len(accs) // 10] - 0.05), min(1.0, max(accs) + 0.01))
    ax2.set(xlabel="total uplink bytes (log)", ylabel="test accuracy (seed 0)",
            title=f"accuracy against uplink bytes (target {target:g} dashed)")
    ax2.legend(fontsize=6, ncol=2)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(results["title"], fontsize=9)
    save_png(fig, out / "accuracy_vs_bits.png")
    return ["accuracy_vs_bits.png"]


def _took(results: Mapping[str, Any]) -> str:
    """Minutes of run time, and how many runs an earlier invocation ran (reused)."""
    runs = [x for r in results["rows"] for x in r["per_seed"]]
    reused = sum(x["reused"] for x in runs)
    took = f"{sum(x['wall_time_s'] for x in runs) / 60:.1f} min of runs"
    if reused:
        took += (f" ({reused} of {len(runs)} runs reused from an earlier invocation; "
                 f"{results['wall_time_s'] / 60:.1f} min this invocation)")
    return took


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "—"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def write_report(results: dict[str, Any], out: Path) -> str:
    """``report.md`` of ``compression``; returns its text."""
    s, rows, m = results["settings"], results["rows"], results["machine"]
    b = results["base_config"]
    lines = [
        f"# {results['title']}", "", f"Papers: {results['paper']}.", "",
        f"Command: `{results['command']}` ({'quick subset' if results['quick'] else 'full'}), "
        f"{_took(results)} on {m['cpus']} CPU cores ({m['backend']}, "
        f"JAX {m['jax']}, {m['platform']}), finished {results['finished']}.", "",
        f"Setting: MNIST, {b['partition']} partition into {b['num_clients']} clients, "
        f"C = {b['client_fraction']:g}, E = {b['local_epochs']}, B = {b['batch_size']}, "
        f"client SGD lr {b['client_lr']:g}, server step 1 (FedAvg), 2NN (199,210 "
        f"parameters); {s['rounds']} rounds, test accuracy every {s['eval_every']} rounds; "
        f"seeds {', '.join(str(x) for x in s['seeds'])}. **Accuracy** = the mean test "
        f"accuracy of the last {s['last_k']} evaluations (seeds averaged). **Bits/coord** = "
        "8 × the bytes of one client's encoded message (its float32 weight included, exactly "
        "what `fedax.federated.comm_cost` counts for the uplink) / 199,210. **Bytes to "
        f"target** = rounds to {s['target']:g} (best-so-far curve, interpolated) × "
        f"{round(b['client_fraction'] * b['num_clients'])} clients × message bytes.", "",
        "| scheme | bits/coord | ratio | accuracy | vs float32 | rounds to target | "
        "uplink bytes to target | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rt = "—" if r["rounds_to_target"] is None else f"{r['rounds_to_target']:.1f}"
        lines.append(
            f"| {r['label']} | {r['bits_per_coordinate']:.3g} | "
            f"{r['compression_ratio']:.1f}× | {r['accuracy']:.4f} | "
            f"{r['minus_uncompressed'] * 100:+.2f} | {rt} | "
            f"{_fmt_bytes(r['uplink_bytes_to_target'])} | {r['wall_time_s']:.0f} |")
    dme = results.get("mean_estimation") or []
    if dme:
        lines += ["", "### Distributed mean estimation (Suresh et al.'s setting)", "",
                  "10 vectors of 16,384 coordinates (N(0, 1) with 8 coordinates ×30: a spiky "
                  "vector), each quantized to b bits per coordinate with a min and max per "
                  "block of 4,096 (`rotation(b)`), with and without the randomized Hadamard "
                  "rotation; the server's mean against the true mean, relative MSE "
                  "E‖x̂ − x̄‖²/‖x̄‖² over 20 draws.", "",
                  "| bits | no rotation | rotation | lower by |", "|---|---|---|---|"]
        lines += [f"| {r['bits']} | {r['plain']:.3g} | {r['rotated']:.3g} | "
                  f"{r['improvement']:.1f}× |" for r in dme]
    lines += ["", "## Claims", ""]
    for c in results["claims"]:
        lines.append(f"- {'✓ held' if c['held'] else '✗ did not hold'}: {c['claim']}: "
                     f"{c['numbers']}.")
    lines += ["", "## Figure", "", "![accuracy vs bits](accuracy_vs_bits.png)", ""]
    quick_notes = paragraph(QUICK_NOTES.format(rounds=s["rounds"], target=s["target"],
                                               schemes=len(rows)))
    lines += notes_sections(NOTES, quick_notes if results["quick"] else "")
    return save_report(lines, out)


QUICK_NOTES = """
`--quick` is sized for this 2-core CPU machine (about 10 minutes): one seed, {rounds} rounds,
target {target:g}, {schemes} schemes. Differences of a few tenths of a point are within
seed-to-seed noise at this length. The full run (no `--quick`) adds QSGD s=3, runs 200 rounds
with three seeds and the target 0.97.
"""

NOTES = """
- Encodings (`fedax.aggregators.compression`, per leaf of the update): QSGD codes
  sign·ξ ∈ {−s..s} in ⌈log₂(2s+1)⌉ bits packed into uint32 words (s = 1: 2 bits; s = 7: 4
  bits) plus a float32 norm per bucket of 512; rotation codes are b bits plus a float32
  min and max per Hadamard block of 4,096 (each leaf zero-padded to whole blocks: 203,280
  coordinates sent for 199,210); top-k sends float32 values and int32 indices (64 bits a
  kept coordinate); int8 a float32 scale per bucket of 512. No entropy coding (QSGD's
  Elias coding, Suresh et al.'s variable-length coding) is used, so the bits are the
  fixed-length ones.
- The rotation's Rademacher signs come from a key in the aggregator's state, broadcast by
  the server (8 bytes a client) and advanced every round; all clients share it, so the
  server inverts the rotation once, on the average.
- Error feedback keeps each client's residual e ← p − C(p) as per-client state (a
  `[100, 199,210]` table in the algorithm state, like SCAFFOLD's control variates); with
  C = 0.1 a client's residual waits about 10 rounds between its visits.
- One learning rate (client lr 0.2, chosen once for float32) for every scheme. The unbiased
  schemes match float32 down to 1-2 bits here: the server averages 10 clients' independent
  quantization errors, and IID MNIST with the 2NN is an easy task; the mean-estimation table
  shows the error the rotation removes, which a harder task (non-IID, fewer clients a
  round) would feel first.
- Error feedback under partial participation: a client's residual is added back only at its
  next visit (about 10 rounds later at C = 0.1), so it may recover less of top-k's gap
  (the table) than in the every-worker-every-step setting of Stich et al. and Karimireddy
  et al.
- The papers' experiments (ImageNet/ResNet for QSGD, distributed mean estimation for
  Suresh et al., logistic regression and CIFAR for the error-feedback papers) are not
  MNIST FedAvg; only their qualitative claims are checked.
"""


COMPRESSION = CustomExperiment(
    name="compression",
    title=TITLE,
    run=run_compression,
    full_description="MNIST 2NN IID, 14 schemes, 200 rounds, 3 seeds, target 97%",
    quick_description="13 schemes, 80 rounds, seed 0, target 95% (≈10 min on 2 cores)",
)

__all__ = ["COMPRESSION", "claims", "message_bytes", "run_compression"]
