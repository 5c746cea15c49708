"""fedax against the hand-written PyTorch loop, Flower and pfl on the cross-device workload.

    .venv-bench/bin/python benchmarks/compare_cross_device.py       # K = 100, 1000, 5000
    .venv-bench/bin/python benchmarks/compare_cross_device.py --per-round 100 --passes 1
    .venv-bench/bin/python benchmarks/compare_cross_device.py --list   # the configurations
    .venv-bench/bin/python benchmarks/compare_cross_device.py --clients 200 --per-round 20 \\
        --rounds 1 --passes 1 --out /tmp/cd                           # toy run

The workload is ``cross_device.py``'s: 10,000 MNIST clients of 20-100 examples (Dirichlet
class mixes), the 2NN, E = 1, B = 10, client SGD lr 0.05, n_k-weighted FedAvg, K clients a
round for each K of ``--per-round``. Every (configuration, K) runs in its own process
(``compare.run_one``: ``bench_cross_device_peers.py IMPL``, which for fedax runs
``gpu/cross_device.py``), so each has its own peak memory. As in ``compare.py`` the measured
rounds are split into ``--passes`` passes; each pass runs every configuration of every K
once (``--warmup`` rounds, then its share), the implementations interleaved and their order
rotated from pass to pass; rounds disturbed by other processes are left out of the
statistics. Each run is bounded by ``--budget`` seconds, start-up included: a peer's run
stops there and keeps the rounds it finished (fedax's, and any run that does not stop, is
killed a minute later); the summary lists every configuration that could not finish its
rounds within the bound, and why.

Writes ``<out>/cross_device_<date>.json`` (every run's record, the workload, machine and
versions) and rewrites its section of ``<out>/summary.md`` (between
``<!-- compare_cross_device.py: newest run -->`` and ``<!-- /compare_cross_device.py -->``,
appended when absent; the rest of the file is kept): for each K a table of seconds per
round, client updates per second, peak memory and the ratio to fedax's default, and a
"Configurations" paragraph saying how each peer was set up.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cross_device_peers as peers  # noqa: E402
import common  # noqa: E402
import compare  # noqa: E402
import cross_device as cd  # noqa: E402

SCRIPT = "bench_cross_device_peers.py"
DEFAULT_PER_ROUND = "100,1000,5000"
BEGIN = "<!-- compare_cross_device.py: newest run -->"
END = "<!-- /compare_cross_device.py -->"
# A run that does not stop at its budget (fedax's has none) is killed this much later.
KILL_AFTER_S = 60.0
NEEDS = {"pytorch": "torch", "flower": "flwr", "pfl": "pfl"}
# What limits an implementation as N and K grow (read in its source), said where it runs out.
LIMITS = {
    "flower": "Flower's simulation engine finds each round's messages node by node: every "
              "0.1 s it asks the in-memory LinkState for the next message of each of the N "
              "nodes, and each ask scans every message not yet answered, so one sweep costs "
              "N x (messages in flight) in Python under the LinkState's lock "
              "(flwr/server/superlink/fleet/vce/vce_api.py `add_messages_to_queue`, "
              "linkstate/in_memory_linkstate.py `get_message_ins`)",
}


def configurations(only: set[str], fedax_strategies: list[str]) -> list[list[dict]]:
    """One list of configurations per implementation (``compare.py``'s, run through
    ``bench_cross_device_peers.py``): fedax's default (then ``fedax_strategies``); pytorch 1
    proc x all cores' threads, x 1 thread, 2 procs x 1 thread; Flower with 1 CPU per
    ClientApp (as many at once as cores: its docs' advice for many clients; 2 CPUs would
    run one small client at a time); pfl as ``compare.py`` runs it, plus 1 proc x 1 thread
    (small clients' matmuls gain nothing from a second thread)."""
    groups = []
    if "fedax" in only:
        groups.append([{"implementation": "fedax", "label": s if s != "default" else "default",
                        "args": ["--strategy", s], "is_default": s == "default"}
                       for s in ["default", *fedax_strategies]])
    if "pytorch" in only:
        groups.append(compare.torch_configs())
    if "flower" in only:
        groups.append(compare.flower_configs()[:1])
    if "pfl" in only:
        pfl = compare.pfl_configs()
        if common.num_cores() > 1:
            pfl.insert(1, {"implementation": "pfl", "args": ["--procs", "1", "--threads", "1"],
                           "label": "1 proc x 1 thread"})
        groups.append(pfl)
    return [[{**c, "script": SCRIPT} for c in g] for g in groups]


def not_installed(only: set[str]) -> list[str]:
    return [impl for impl, module in NEEDS.items()
            if impl in only and importlib.util.find_spec(module) is None]


def finish_row(records: list[dict], per_round: int) -> dict[str, Any]:
    """One configuration's passes at one K -> its row (``compare.merge``, plus the rates,
    the cut-offs and fedax's resolved default)."""
    row = compare.merge(records)
    ok = [r for r in records if not r.get("error")]
    row["model"] = cd.MODEL
    row["clients_per_round"] = per_round
    if ok and row.get("config") == "default" and ok[0].get("execution"):
        e = ok[0]["execution"]
        row["config"] = f"default ({e['map']}:{e['steps']}:{e['devices']})"
    if ok:
        cd.add_rates(row, per_round, ok[0]["workload"]["sizes"]["mean"])
    cut = [r["cut_off"] for r in ok if r.get("cut_off")]
    if cut:
        row["cut_off"] = cut
    return row


def add_ratios(rows: list[dict]) -> None:
    """``ratio_to_fedax``: fedax's default's client updates per second over the row's (> 1:
    the row is slower)."""
    base = next((r for r in rows if r.get("is_default") and r.get("client_updates_per_s")),
                None)
    for r in rows:
        if base and r.get("client_updates_per_s"):
            r["ratio_to_fedax"] = base["client_updates_per_s"] / r["client_updates_per_s"]


def why_not(row: dict) -> str | None:
    """Why a configuration did not finish its rounds within the bound (None: it did)."""
    if row.get("error"):
        return row["error"]
    cuts = row.get("cut_off") or []
    if not cuts:
        return None
    c = max(cuts, key=lambda c: c["rounds_done"])
    if c["phase"] == "start-up":
        return f"its start-up alone took over the {c['budget_s']:g} s bound (no round begun)"
    text = (f"cut off at the {c['budget_s']:g} s bound after {c['rounds_done']} of "
            f"{c['rounds_planned']} rounds (start-up {c['startup_s']:.0f} s); round "
            f"{c['in_round']} had run {c['round_running_s']:.0f} s")
    if c["phase"] == "warm-up":
        text += ", so no measured round"
    runs = row.get("passes", 0) + row.get("failed_passes", 0)
    if runs > 1:
        text += f" ({len(cuts)} of {runs} passes cut off; the figures are those of all passes)"
    return text


def limit(row: dict) -> str:
    """What limits the row's implementation (:data:`LIMITS`), for a run out of time."""
    timed_out = row.get("cut_off") or "timeout" in (row.get("error") or "")
    return f". {LIMITS[row['implementation']]}." if timed_out and row[
        "implementation"] in LIMITS else ""


COLUMNS = ("implementation", "configuration", "s/round median", "min", "max",
           "client-updates/s", "peak RSS MB", "peak PSS MB", "x fedax", "rounds kept")


def _number(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    fmt = common._fmt_seconds
    for r in rows:
        s = r.get("s_per_round") or {}
        kept = "—" if "rounds_total" not in r else f"{r['rounds_kept']}/{r['rounds_total']}"
        if r.get("error"):
            kept = f"FAILED: {r['error']}"
        elif r.get("cut_off"):
            kept += " (cut off)"
        elif r.get("all_disturbed"):
            kept += " (all disturbed)"
        cells = [r["implementation"], r["config"], fmt(s.get("median")), fmt(s.get("min")),
                 fmt(s.get("max")), _number(r.get("client_updates_per_s")),
                 _number(r.get("peak_rss_mb")), _number(r.get("peak_pss_mb")),
                 "—" if r.get("ratio_to_fedax") is None else f"{r['ratio_to_fedax']:.2f}", kept]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section(data: dict, name: str) -> str:
    """The summary's section for the comparison ``data`` (written to ``name``)."""
    m = data["machine"]
    w = next(iter(data["workload"].values()), None) or {}
    sizes = w.get("sizes", {})
    parts = [
        f"## Cross-device: {data['clients']:,} clients, K a round ({name})\n",
        f"{data['date']}; {m.get('cpu', '?')}, {m['cores']} cores, "
        f"{m.get('mem_total_gib', '?')} GiB. MNIST clients of {sizes.get('min', '?')}-"
        f"{sizes.get('max', '?')} examples (mean {sizes.get('mean', 0):.1f}, Dirichlet class "
        f"mixes α = {w.get('alpha', '?')}), the 2NN, E = 1, B = 10, client SGD lr 0.05, "
        f"n_k-weighted FedAvg; {data['rounds_per_config']} measured rounds per configuration "
        f"in {data['passes']} passes after {data['warmup_per_run']} warm-up round(s) a run; "
        f"each run bounded to {data['budget_s']:g} s, start-up included. client-updates/s is "
        "K / the median s a round; 'x fedax' is fedax's default's client-updates/s divided by "
        "the configuration's (> 1: slower than fedax).\n",
    ]
    for k in data["per_round"]:
        rows = data["results"][str(k)]
        parts.append(f"### {k:,} clients a round\n")
        parts.append(table(rows) + "\n")
        missed = [f"- {r['implementation']} {r['config']}: {why_not(r)}{limit(r)}"
                  for r in rows if why_not(r)]
        if missed:
            parts.append("Not run to the end within the bound:\n\n" + "\n".join(missed) + "\n")
    parts.append("Configurations: " + " ".join(
        data["setup"][k] for k in ("fedax", "pytorch", "flower", "pfl")) + "\n")
    return "\n".join(parts)


def update_summary(path: Path, block: str) -> None:
    """Put ``block`` between this script's markers in ``path``, keeping the rest of the
    file; append it (markers included) where they are not there yet."""
    block = f"{BEGIN}\n\n{block}\n{END}"
    text = path.read_text() if path.exists() else ""
    head, begin, rest = text.partition(BEGIN)
    if begin and END in rest:
        text = head + block + rest.split(END, 1)[1]
    else:
        if text:
            text += "\n" if text.endswith("\n") else "\n\n"
        text += block + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-round", default=DEFAULT_PER_ROUND,
                        help="comma-separated K, clients a round")
    parser.add_argument("--clients", type=int, default=cd.NUM_CLIENTS, help="N, the population")
    parser.add_argument("--rounds", type=int, default=4,
                        help="measured rounds per configuration and K, over all passes")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds per run")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--budget", type=float, default=peers.DEFAULT_BUDGET_S,
                        help="seconds per run, start-up included")
    parser.add_argument("--only", default="fedax,pytorch,flower,pfl",
                        help="comma-separated implementations to run")
    parser.add_argument("--fedax-strategies", default="",
                        help="comma-separated MAP:STEPS:DEVICES run besides fedax's default")
    parser.add_argument("--cooldown", type=float, default=2.0, help="seconds between runs")
    parser.add_argument("--out", default=str(common.RESULTS_DIR))
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    args = parser.parse_args(argv)
    sizes = [int(k) for k in args.per_round.split(",")]
    if not all(1 <= k <= args.clients for k in sizes):
        parser.error(f"--per-round: each K must lie in [1, {args.clients}]")
    only = set(args.only.split(","))
    if only - set(peers.IMPLS):
        parser.error(f"--only: unknown {sorted(only - set(peers.IMPLS))}")
    passes = max(1, min(args.passes, args.rounds))
    per_pass = [args.rounds // passes + (p < args.rounds % passes) for p in range(passes)]
    missing = not_installed(only)
    strategies = [s for s in args.fedax_strategies.split(",") if s]
    configs = compare.interleave(configurations(only - set(missing), strategies))
    if args.list:
        for c in configs:
            print(f"{c['implementation']:8} {c['label']:28} {SCRIPT} {c['implementation']} "
                  f"{' '.join(c['args'])}")
        for impl in missing:
            print(f"{impl:8} not installed here ({NEEDS[impl]})")
        return 0

    work = Path(tempfile.mkdtemp(prefix="fedax-cross-device-"))
    print(f"machine: {common.machine_info()}\n{len(configs)} configurations x K in {sizes} "
          f"x {passes} passes ({per_pass} measured rounds, +{args.warmup} warm-up each, "
          f"{args.budget:g} s a run at most); logs in {work}", flush=True)
    records: dict[tuple[int, int], list[dict]] = {}
    for p in range(passes):
        shift = p % len(configs) if configs else 0
        order = list(range(len(configs)))[shift:] + list(range(len(configs)))[:shift]
        for k in sizes:
            for i in order:
                c = configs[i]
                c = {**c, "args": [*c["args"], "--per-round", str(k), "--clients",
                                   str(args.clients), "--budget", f"{args.budget:g}"]}
                print(f"[pass {p + 1}/{passes}] K={k} {c['implementation']} {c['label']} ...",
                      flush=True)
                name = f"k{k}_{i:02d}_{c['implementation']}_p{p}"
                record = compare.run_one(c, c["implementation"], per_pass[p], args.warmup,
                                         work / f"{name}.json", work / f"{name}.log",
                                         args.budget + KILL_AFTER_S)
                s = record.get("s_per_round")
                if s:
                    print(f"  {s['median']:.3f} s/round, {k / s['median']:.0f} client "
                          f"updates/s, {record['rounds_kept']}/{record['rounds_total']} "
                          "undisturbed", flush=True)
                if record.get("cut_off"):
                    print(f"  cut off: {record['cut_off']}", flush=True)
                records.setdefault((k, i), []).append(record)
                time.sleep(args.cooldown)

    results, workloads = {}, {}
    for k in sizes:
        rows = []
        for i, c in enumerate(configs):
            row = finish_row(records[(k, i)], k)
            row["is_default"] = c.get("is_default", False)
            rows.append(row)
            done = next((r for r in records[(k, i)] if r.get("workload")), None)
            if done and k not in workloads:
                workloads[k] = done["workload"]
        rows += [{"implementation": impl, "config": "—", "model": cd.MODEL,
                  "clients_per_round": k, "error": f"{NEEDS[impl]} not installed here "
                                                   "(make bench-env)"} for impl in missing]
        add_ratios(rows)
        results[str(k)] = rows

    data = {
        "date": common.now_iso(),
        "clients": args.clients,
        "per_round": sizes,
        "workload": {str(k): w for k, w in workloads.items()},
        "machine": common.machine_info(),
        "versions": common.versions("jax", "jaxlib", "optax", "torch", "flwr", "ray", "pfl",
                                    "fedax"),
        "rounds_per_config": args.rounds,
        "warmup_per_run": args.warmup,
        "passes": passes,
        "budget_s": args.budget,
        "disturbed_threshold_cores": common.DISTURBED_CORES,
        "setup": peers.SETUP,
        "results": results,
    }
    out_dir = Path(args.out)
    out = common.dated_result(out_dir, "cross_device")
    common.write_json(out, data)
    update_summary(out_dir / "summary.md", section(data, out.name))
    for k in sizes:
        print(f"\nK = {k}\n" + table(results[str(k)]))
    print(f"\nwrote {out} and {out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
