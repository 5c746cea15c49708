"""Karimireddy et al. 2020 (SCAFFOLD), Table 3: rounds to 0.5 test accuracy, logistic
regression, SCAFFOLD beside FedAvg, FedProx and SGD, with MNIST standing in for EMNIST.

The paper's protocol (docs/references.md, client drift and heterogeneous data): N = 100
clients, 20% sampled per round, s% similarity (s% of each client's data IID, the rest sorted
by label) for s ∈ {0, 10, 100}; the local methods take 5 steps per epoch (batch = 0.2 of the
local data) for E ∈ {1, 5} here (the paper also has 10 and 20); SGD takes one step on the
sampled clients' full data per round; η_g = 1, η_l tuned per cell, FedProx μ = 1, SCAFFOLD
Option II.
"""

from __future__ import annotations

from fedax.reproduce.framework import Cell, Experiment

SIMILARITY = (("s=0%", 0.0), ("s=10%", 0.1), ("s=100%", 1.0))

# Table 3 (EMNIST, target 0.5): {(method, E): (0%, 10%, 100%)}; None = "1k+" (not reached).
TABLE3 = {
    ("SGD", 1): (317, 365, 416),
    ("SCAFFOLD", 1): (77, 62, 60), ("SCAFFOLD", 5): (152, 20, 10),
    ("FedAvg", 1): (258, 74, 83), ("FedAvg", 5): (428, 34, 10),
    ("FedProx", 1): (None, 979, 459), ("FedProx", 5): (None, 794, 351),
}
_ALGORITHM = {"SGD": "fedsgd", "SCAFFOLD": "scaffold", "FedAvg": "fedavg", "FedProx": "fedprox"}

# n_k = 600 for every client (MNIST's 60,000 / 100), so 0.2 n_k = 120: 5 steps an epoch.
LOCAL_BATCH = 120
# The harder target (see the notes): where the methods separate on MNIST.
HARD_TARGET = 0.85

# Learning-rate grids on the 10^(1/2) lattice: SGD takes one full-batch step a round.
SGD_LRS = (0.316, 1.0, 3.16, 10.0, 31.6)
LOCAL_LRS = (0.0316, 0.1, 0.316, 1.0, 3.16)


def _cell(method: str, e: int, group: str, s: float, *, target: float = 0.5,
          lrs=None, rounds: int = 300, eval_every: int = 1) -> Cell:
    sgd = method == "SGD"
    paper = TABLE3[(method, e)][[x for _, x in SIMILARITY].index(s)] if target == 0.5 else None
    config = {"algorithm": _ALGORITHM[method], "similarity": s, "rounds": rounds,
              "eval_every": eval_every, "target_accuracy": target}
    if not sgd:
        config.update(local_epochs=e, batch_size=LOCAL_BATCH)
    if method == "FedProx":
        config["mu"] = 1.0
    suffix = "" if target == 0.5 else f"-t{round(target * 100)}"
    note = ""
    if paper is None and target == 0.5 and method == "FedProx" and s == 0.0:
        note = "paper: 1k+ (not reached in 1,000 rounds)"
    return Cell(
        name=f"{method.lower()}-e{e}-s{round(s * 100)}{suffix}", method=method,
        group=group if target == 0.5 else f"{group}, target {target:.0%}", config=config,
        lr_grid=lrs or (SGD_LRS if sgd else LOCAL_LRS), paper=paper, baseline=sgd,
        note=note,
    )


def _group(group: str, s: float, target: float, rounds: int) -> list[Cell]:
    cells = [_cell("SGD", 1, group, s, target=target, rounds=rounds)]
    for method in ("SCAFFOLD", "FedAvg", "FedProx"):
        cells += [_cell(method, e, group, s, target=target, rounds=rounds) for e in (1, 5)]
    return cells


# --quick: the s=0% groups, each cell at the learning rate its full grid picked in a pilot
# run of the s=0% groups on this machine: {(method, E, target): lr}.
QUICK_LRS = {
    ("SGD", 1, 0.5): 0.316, ("SCAFFOLD", 1, 0.5): 0.316, ("SCAFFOLD", 5, 0.5): 0.316,
    ("FedAvg", 1, 0.5): 0.316, ("FedAvg", 5, 0.5): 0.316, ("FedProx", 1, 0.5): 1.0,
    ("FedProx", 5, 0.5): 0.0316,
    ("SGD", 1, HARD_TARGET): 10.0, ("SCAFFOLD", 1, HARD_TARGET): 0.316,
    ("SCAFFOLD", 5, HARD_TARGET): 0.316, ("FedAvg", 1, HARD_TARGET): 3.16,
    ("FedAvg", 5, HARD_TARGET): 3.16, ("FedProx", 1, HARD_TARGET): 1.0,
    ("FedProx", 5, HARD_TARGET): 1.0,
}


def _quick() -> list[Cell]:
    cells = []
    for target, rounds in ((0.5, 100), (HARD_TARGET, 300)):
        for (method, e, t), lr in QUICK_LRS.items():
            if t == target:
                cells.append(_cell(method, e, "s=0%", 0.0, target=target, lrs=(lr,),
                                   rounds=rounds))
    return cells


def _full() -> list[Cell]:
    cells = []
    for group, s in SIMILARITY:
        cells += _group(group, s, 0.5, 100)
    for group, s in SIMILARITY:
        cells += _group(group, s, HARD_TARGET, 300)
    return cells


def _rounds(cells, method, e, group):
    for c in cells:
        if (c["method"], c["local_epochs"], c["group"]) == (method, e, group):
            return c["rounds_to_target"], c["rounds_cap"]
    return None


def _observations(results, out) -> str:
    """The two comparisons the paper's Table 3 is about, read off this run's table."""
    del out
    cells = results["cells"]
    lines = ["## Observations (computed from the table above)", ""]

    def fmt(r):
        rounds, cap = r
        return f"{rounds:g}" if rounds is not None else f"not reached in {cap}"

    for group in dict.fromkeys(c["group"] for c in cells):
        parts = []
        for e in (1, 5):
            sc, fa = _rounds(cells, "SCAFFOLD", e, group), _rounds(cells, "FedAvg", e, group)
            if sc and fa:
                ratio = f" (FedAvg / SCAFFOLD = {fa[0] / sc[0]:.1f})" if sc[0] and fa[0] else ""
                parts.append(f"E={e}: SCAFFOLD {fmt(sc)} vs FedAvg {fmt(fa)} rounds{ratio}")
        e1, e5 = _rounds(cells, "FedAvg", 1, group), _rounds(cells, "FedAvg", 5, group)
        if e1 and e5:
            parts.append(f"FedAvg E=1 {fmt(e1)} vs E=5 {fmt(e5)} rounds")
        if parts:
            lines.append(f"- {group}: " + "; ".join(parts) + ".")
    return "\n".join(lines)


_NOTES = f"""
- **MNIST stands in for EMNIST**, so the paper's numbers (the "rounds (paper)" column and
  its speedups) are EMNIST numbers, shown for the shape only. MNIST is much easier for a
  linear model (a centralized logistic regression reaches about 0.92 test accuracy), so the
  paper's 0.5 target falls within the first handful of rounds for every method and
  partition and separates nothing: read those groups as "all reach it at once".
- The groups marked "target {HARD_TARGET:.0%}" repeat the table at a harder target, where the
  methods do separate. {HARD_TARGET:.0%} was chosen by us after a pilot run had shown the 0.5
  target to be uninformative (about 0.92 of the centralized accuracy, where client drift
  matters); it is not the paper's, and other choices (0.8, 0.88) move the
  numbers. No paper values exist for it.
- Partition: SCAFFOLD's s-similarity (`fedax.data.similarity`): s% of the examples are
  dealt IID, the rest sorted by label and cut into 100 contiguous chunks, one per client, so
  every client has 600 examples (at s = 0%, one or two labels each).
- Methods (as in the paper): SGD = FedSGD (one step on the 20 sampled clients' full data, the
  n_k-weighted mean gradient); SCAFFOLD Option II with the paper's uniform 1/|S| average;
  FedAvg (n_k weights, equal here); FedProx with μ = 1; all with η_g = 1 (server SGD at lr
  1). Local methods: B = {LOCAL_BATCH} = 0.2·n_k, i.e. 5 steps per epoch.
- Model: multinomial logistic regression, 784 → 10, zero initial weights.
- Learning rate η_l (SGD: its one step size) from {{{", ".join(f"{x:g}" for x in LOCAL_LRS)}}}
  for the local methods and {{{", ".join(f"{x:g}" for x in SGD_LRS)}}} for SGD, the best per
  cell (fewest rounds to the target; the paper tunes η_l per method). Test accuracy is
  evaluated every round.
- Large learning rates: from zero weights, logistic regression's predictions (an argmax)
  do not depend on the scale of W, and at large η the softmax saturates, so the trajectory
  approaches η × a fixed path: rounds to target stop changing with η beyond about 1-3 (SGD
  reads the same at 3.16, 10 and 31.6). An "(edge)" at the top of a grid therefore does not
  mean a larger η would do better. FedProx with μ = 1 at η = 1 is a special case: ημ = 1
  makes each local step y ← x − η∇F(y), a fixed-point iteration around the server model.
- One seed (0) per cell; caps of 100 rounds (target 0.5) and 300 rounds (target
  {HARD_TARGET:.0%}) instead of the paper's 1,000.
"""

SCAFFOLD_MNIST = Experiment(
    name="scaffold-mnist",
    title="SCAFFOLD vs FedAvg, FedProx, SGD: logistic regression on MNIST",
    paper="Karimireddy et al. 2020, Table 3 (EMNIST, logistic regression, 20% of 100 "
          "clients, rounds to 0.5 test accuracy); our data set is MNIST",
    base={"seed": 0, "dataset": "mnist", "num_clients": 100, "partition": "similarity",
          "model": "logistic", "client_fraction": 0.2, "server": {"optimizer": "sgd",
                                                                   "lr": 1.0},
          "stop_at_target": True, "target_accuracy": 0.5, "checkpoint_every": 50},
    full=_full(),
    quick=_quick(),
    notes=_NOTES,
    quick_notes="""
`--quick` runs the s = 0% column only (where the paper's SCAFFOLD-FedAvg gap is largest),
at both targets, each cell at one learning rate: the one its full grid picked in a pilot run
of the s = 0% cells on this machine (so the quick numbers are those of the full grid for
this column; the s = 10% and 100% columns are not run). It took 4.9 minutes of wall time
on this 2-core machine while other jobs ran on it (load average 7-9).
""",
    extra_report=_observations,
    columns=("local_epochs", "batch_size", "target_accuracy"),
    full_time="""
`fedax reproduce scaffold-mnist` runs all 42 cells (3 partitions × 7 methods × 2 targets)
over 5 learning rates each (a grid point stops one evaluation after the best one so far
has reached the target). The s = 0% cells took about 20 minutes on this 2-core machine
(shared with other jobs), so the whole table is roughly an hour. It resumes where it
stopped.
""",
)
