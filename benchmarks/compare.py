"""fedax vs a hand-written PyTorch loop vs Flower vs pfl vs the FLOP/s limit, on workload W.

    python benchmarks/compare.py 2nn                 # results -> benchmarks/results/
    python benchmarks/compare.py cnn --rounds 4 --passes 2
    python benchmarks/compare.py 2nn --rounds 1 --passes 1 --out /tmp/smoke   # smoke run

Every configuration runs in its own subprocess (its own peak RSS, its own XLA device
count). The measured rounds are split into ``--passes`` passes; each pass runs every
configuration once (a warm-up of ``--warmup`` rounds, then its share of the rounds), the
implementations interleaved and the order rotated from pass to pass, so that slow drifts of
a shared machine spread over all of them. Rounds during which other processes used more
than 0.2 of a core (or the hypervisor stole it) are left out of the statistics; the table
says how many were kept. Writes ``<out>/<model>_<date>.json`` and rewrites
the newest comparison of each model into ``<out>/summary.md`` (between its markers; the
rest of the file, the analyses of earlier runs, is kept).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PYTHON = sys.executable
HERE = common.HERE
DEFAULT_ROUNDS = {"2nn": 10, "cnn": 4}


def fedax_default(model: str) -> dict:
    import subprocess

    out = subprocess.run(
        [PYTHON, str(HERE / "bench_fedax.py"), model, "--print-default"],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def fedax_configs(model: str, strategies: list[str] | None, conv_impls: list[str],
                  all_strategies: bool, all_convs: bool,
                  precisions: Sequence[str] = ("float32",)) -> list[dict]:
    """fedax's configurations: the default, then every Execution(map, steps, devices) with
    devices 1 and one per core, and ``processes`` with one worker per core (``unroll`` map x
    ``unroll`` steps only with
    ``all_strategies``: 10 x 300 straight-line steps take very long to compile). The
    explicit strategy equal to the default (same devices on the same host split) is not run
    twice. For the CNN, each convolution form in ``conv_impls``; but unless ``all_convs``
    (or explicit ``strategies``), ``lax`` (the model's default form) only with the default
    strategy: every other strategy keeps convolutions inside a loop (scan, lax.map) or
    vmap, where XLA:CPU runs autodiff's ``lax`` weight-gradient convolutions several times
    slower than ``patches`` or ``lax_vjp`` (fedax's CPU default). Each in every precision
    of ``precisions`` (``bfloat16``: ``precision: bfloat16``, float32 master weights)."""
    cores = common.num_cores()
    default = fedax_default(model)
    default_text = f"{default['map']}:{default['steps']}:{default['devices']}"
    explicit = strategies is not None
    if strategies is None:
        strategies = ["default"]
        for devices in sorted({1, cores}):
            for steps in ("scan", "unroll"):
                for map_ in ("sequential", "vmap", "unroll"):
                    if map_ == steps == "unroll" and not all_strategies:
                        continue
                    text = f"{map_}:{steps}:{devices}"
                    if text == default_text and default["host_devices"] == devices:
                        continue
                    strategies.append(text)
        if cores > 1 and not (default_text == f"processes:scan:{cores}"):
            strategies.append(f"processes:scan:{cores}")  # one worker process per core
    impls = conv_impls if model == "cnn" else [None]
    configs = []
    for precision in precisions:
        for conv in impls:
            for strategy in strategies:
                if conv == "lax" and strategy != "default" and not (explicit or all_convs):
                    continue
                args = ["--strategy", strategy]
                label = strategy if strategy != "default" else f"default ({default_text})"
                if conv is not None:
                    args += ["--conv-impl", conv]
                    label += f" conv={conv}"
                if precision != "float32":
                    args += ["--precision", precision]
                    label += f" {precision}"
                configs.append({"implementation": "fedax", "label": label,
                                "script": "bench_fedax.py", "args": args,
                                "is_default": strategy == "default"
                                and conv in (None, "auto") and precision == "float32"})
    return configs


def torch_configs() -> list[dict]:
    cores = common.num_cores()
    out = [{"args": ["--procs", "1", "--threads", str(cores)],
            "label": f"1 proc x {cores} threads"}]
    if cores > 1:
        out.append({"args": ["--procs", "1", "--threads", "1"], "label": "1 proc x 1 thread"})
        out.append({"args": ["--procs", "2", "--threads", "1"], "label": "2 procs x 1 thread"})
    return [{"implementation": "pytorch", "script": "bench_torch.py", **c} for c in out]


def flower_configs() -> list[dict]:
    cores = common.num_cores()
    return [
        {"implementation": "flower", "script": "bench_flower.py",
         "args": ["--cpus-per-client", str(c)],
         "label": f"{c} cpu/client ({cores // c} concurrent)"}
        for c in (1, 2) if c <= cores
    ]


def pfl_configs() -> list[dict]:
    """Apple's pfl-research (PyTorch backend): one process with one intra-op thread per core
    (as pytorch's first row), and pfl's multi-process simulation with one single-threaded
    process per core (torch.distributed, gloo) where there are 2 or more cores."""
    cores = common.num_cores()
    out = [{"args": ["--procs", "1", "--threads", str(cores)],
            "label": f"1 proc x {cores} thread" + ("s" if cores > 1 else "")}]
    if cores > 1:
        out.append({"args": ["--procs", "2", "--threads", "1"], "label": "2 procs x 1 thread"})
    return [{"implementation": "pfl", "script": "bench_pfl.py", **c} for c in out]


def interleave(groups: list[list[dict]]) -> list[dict]:
    """Round-robin over the implementations: fedax, pytorch, flower, pfl, fedax, ..."""
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out += [g[i] for g in groups if i < len(g)]
        i += 1
    return out


def run_one(config: dict, model: str, rounds: int, warmup: int, json_path: Path,
            log_path: Path, timeout: float) -> dict:
    """Run one configuration in a subprocess (its own session); returns its record, or an
    error record. Also records the largest single process's peak RSS (``wait4``)."""
    import subprocess

    argv = [PYTHON, str(HERE / config["script"]), model, *config["args"],
            "--rounds", str(rounds), "--warmup", str(warmup), "--json", str(json_path)]
    started = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        status, usage = None, None
        while status is None:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, usage = os.waitstatus_to_exitcode(st), ru
                proc.returncode = status
                break
            if time.monotonic() - started > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                _, st, ru = os.wait4(proc.pid, 0)
                status, usage = "timeout", ru
                proc.returncode = -9
                break
            time.sleep(0.2)
    elapsed = time.monotonic() - started
    base = {"implementation": config["implementation"], "config": config["label"],
            "model": model, "wall_s": elapsed, "argv": argv[1:],
            "largest_process_maxrss_mb": usage.ru_maxrss / 1024 if usage else None}
    # A run stopped at its budget has its record written before its workers were stopped;
    # the run itself may then exit with an error of its own (Flower's runtime exits 1 when
    # its Ray workers go away): the record, which says it was cut off, is what counts.
    cut_off = json_path.exists() and "cut_off" in json.loads(json_path.read_text())
    if not cut_off and (status != 0 or not json_path.exists()):
        tail = log_path.read_text().strip().splitlines()[-15:]
        why = f"timeout after {timeout:.0f} s" if status == "timeout" else f"exit {status}"
        print(f"  FAILED ({why}); log {log_path}:\n    " + "\n    ".join(tail), flush=True)
        return {**base, "error": why}
    record = json.loads(json_path.read_text())
    record.update(base)
    return record


def merge(records: list[dict]) -> dict:
    """One configuration's passes -> one row (rounds pooled)."""
    ok = [r for r in records if not r.get("error")]
    first = (ok or records)[0]
    if not ok:
        return {k: first[k] for k in ("implementation", "config", "model", "error")}
    rounds = [x for r in ok for x in r["rounds"]]
    # The workload is the comparison's, recorded once at its top level.
    row = {k: v for k, v in ok[0].items() if k not in ("rounds", "warmup_s", "workload")}
    row.update(common.summarize(rounds))
    row["rounds"] = rounds
    row["warmup_s"] = [w for r in ok for w in r["warmup_s"]]
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
    pss = [r["peak_pss_mb"] for r in ok if r.get("peak_pss_mb")]
    row["peak_pss_mb"] = max(pss) if pss else None
    sizes = [r["largest_process_maxrss_mb"] for r in ok if r.get("largest_process_maxrss_mb")]
    row["largest_process_maxrss_mb"] = max(sizes) if sizes else None
    row["passes"] = len(ok)
    row["failed_passes"] = len(records) - len(ok)
    row["wall_s"] = sum(r["wall_s"] for r in records)
    return row


_LATEST_BEGIN = "<!-- compare.py: newest runs (rewritten by each run) -->"
_LATEST_END = "<!-- /compare.py -->"


def _newest(out_dir: Path, model: str) -> Path | None:
    """The newest full comparison of ``model`` in ``out_dir`` by the date it records (file
    names do not sort by date: ``2nn_ab_...`` sorts after ``2nn_2026-...``)."""
    newest, date = None, ""
    for path in out_dir.glob(f"{model}_*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "results" in data and data.get("date", "") > date:
            newest, date = path, data["date"]
    return newest


def latest_markdown(out_dir: Path) -> str:
    """Markdown for the newest ``<model>_*.json`` comparison of each model in ``out_dir``."""
    parts = [
        "Configurations: fedax's execution strategy (`map:steps:devices`); pytorch, a "
        "hand-written loop (`P procs x T threads`); flower, Flower's Ray simulation engine "
        "(`c cpu/client`); pfl, Apple's pfl-research with its PyTorch backend (`P procs x T "
        "threads`, 2 procs: pfl's multi-process simulation over torch.distributed); all "
        "but fedax train the same PyTorch model.\n",
    ]
    for model in common.MODELS:
        path = _newest(out_dir, model)
        if path is None:
            continue
        data = json.loads(path.read_text())
        m = data["machine"]
        peak = data["matmul_peak"]["flops"] / 1e9
        parts.append(f"## Newest: {model.upper()} ({path.name})\n")
        parts.append(
            f"{data['date']}; {m.get('cpu', '?')}, {m['cores']} cores, "
            f"{m.get('mem_total_gib', '?')} GiB; float32 matmul peak {peak:.1f} GFLOP/s "
            f"(NumPy, all cores); {data['flops_per_round'] / 1e9:.1f} GFLOP per round; "
            f"{data['rounds_per_config']} measured rounds per configuration in "
            f"{data['passes']} passes.\n"
        )
        parts.append(common.markdown_table(data["results"]) + "\n")
    return "\n".join(parts)


def update_summary(out_dir: Path) -> Path:
    """Put :func:`latest_markdown` into ``out_dir/summary.md`` between its markers (after
    the title and the workload paragraph when the markers are not there yet), keeping
    everything else in the file: the written analyses of earlier runs stay."""
    path = out_dir / "summary.md"
    block = f"{_LATEST_BEGIN}\n\n{latest_markdown(out_dir)}\n{_LATEST_END}"
    if not path.exists():
        path.write_text(f"{_HEADER}\n{block}\n")
        return path
    text = path.read_text()
    if _LATEST_BEGIN in text and _LATEST_END in text:
        head, rest = text.split(_LATEST_BEGIN, 1)
        text = head + block + rest.split(_LATEST_END, 1)[1]
    else:
        cut = text.find("\n## ")
        text = (text + "\n" + block + "\n" if cut < 0
                else text[: cut + 1] + "\n" + block + "\n" + text[cut:])
    path.write_text(text)
    return path


_HEADER = (
    "# fedax benchmarks: seconds per FedAvg round\n\n"
    "Workload W (McMahan et al. 2017, MNIST): 100 IID clients x 600 examples, 10 clients a "
    "round, E = 5, B = 10 (300 SGD steps per client, 30,000 examples a round), client SGD lr "
    "0.05, n_k-weighted averaging. Medians over undisturbed rounds after a warm-up; 'x fedax' "
    "is s/round divided by fedax's default configuration's (> 1: slower than fedax). How to "
    "read and rerun: `benchmarks/README.md`.\n"
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=common.MODELS)
    parser.add_argument("--rounds", type=int, default=None,
                        help="measured rounds per configuration, over all passes "
                             f"(default {DEFAULT_ROUNDS})")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds per run")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--only", default="fedax,pytorch,flower,pfl",
                        help="comma-separated implementations to run")
    parser.add_argument("--fedax-strategies", default=None,
                        help="comma-separated MAP:STEPS:DEVICES or default (default: all)")
    parser.add_argument("--all-strategies", action="store_true",
                        help="also fedax's unroll:unroll (slow to compile)")
    parser.add_argument("--conv-impls", default="auto,lax_vjp,patches,lax",
                        help="CNN convolution forms for fedax (comma-separated)")
    parser.add_argument("--fedax-precisions", default="float32",
                        help="fedax's compute precisions, comma-separated: float32, bfloat16 "
                             "(opt-in mixed precision; pays where the CPU has bf16 products)")
    parser.add_argument("--all-convs", action="store_true",
                        help="CNN: every strategy with every form (default: lax only with "
                             "fedax's default strategy)")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per run")
    parser.add_argument("--cooldown", type=float, default=2.0, help="seconds between runs")
    parser.add_argument("--out", default=str(common.RESULTS_DIR))
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    args = parser.parse_args(argv)
    model = args.model
    total_rounds = args.rounds or DEFAULT_ROUNDS[model]
    passes = max(1, min(args.passes, total_rounds))
    per_pass = [total_rounds // passes + (p < total_rounds % passes) for p in range(passes)]
    only = set(args.only.split(","))
    unknown = only - {"fedax", "pytorch", "flower", "pfl"}
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}")

    groups, errors = [], []
    if "fedax" in only:
        strategies = args.fedax_strategies.split(",") if args.fedax_strategies else None
        precisions = args.fedax_precisions.split(",")
        unknown_precisions = sorted(set(precisions) - {"float32", "bfloat16"})
        if unknown_precisions:
            parser.error(f"--fedax-precisions: unknown {unknown_precisions}")
        groups.append(fedax_configs(model, strategies, args.conv_impls.split(","),
                                    args.all_strategies, args.all_convs, precisions))
    for name, module, make in (("pytorch", "torch", torch_configs),
                               ("flower", "flwr", flower_configs),
                               ("pfl", "pfl", pfl_configs)):
        if name not in only:
            continue
        if importlib.util.find_spec(module) is None:
            errors += [{**c, "config": c["label"], "model": model,
                        "error": f"{module} not installed here (make bench-env)"}
                       for c in make()]
        else:
            groups.append(make())
    configs = interleave(groups)
    if args.list:
        for c in configs:
            print(f"{c['implementation']:8} {c['label']:40} {c['script']} {' '.join(c['args'])}")
        for e in errors:
            print(f"{e['implementation']:8} {e['config']:40} {e['error']}")
        return 0

    print(f"machine: {common.machine_info()}", flush=True)
    print("measuring the float32 matmul peak ...", flush=True)
    peak_before = common.measure_matmul_peak()
    single_core = common.measure_matmul_peak(threads=1)
    print(f"  {peak_before['flops'] / 1e9:.1f} GFLOP/s all cores, "
          f"{single_core['flops'] / 1e9:.1f} GFLOP/s one core", flush=True)

    work = Path(tempfile.mkdtemp(prefix=f"fedax-bench-{model}-"))
    print(f"{len(configs)} configurations x {passes} passes ({per_pass} measured rounds, "
          f"+{args.warmup} warm-up each); logs in {work}", flush=True)
    by_key: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    for p in range(passes):
        shift = p % len(configs) if configs else 0
        order = list(range(len(configs)))[shift:] + list(range(len(configs)))[:shift]
        for i in order:
            c = configs[i]
            print(f"[pass {p + 1}/{passes}] {c['implementation']} {c['label']} ...", flush=True)
            name = f"{i:02d}_{c['implementation']}_p{p}"
            record = run_one(c, model, per_pass[p], args.warmup, work / f"{name}.json",
                             work / f"{name}.log", args.timeout)
            if not record.get("error"):
                s = record.get("s_per_round", {})
                print(f"  {s.get('median', float('nan')):.3f} s/round, "
                      f"{record['rounds_kept']}/{record['rounds_total']} undisturbed, "
                      f"warm-up {[round(w, 1) for w in record['warmup_s']]} s", flush=True)
            by_key[i].append(record)
            time.sleep(args.cooldown)

    peak_after = common.measure_matmul_peak()
    peak = max(peak_before, peak_after, key=lambda r: r["flops"])
    flops = common.flops_per_round(model)
    rows = [merge(by_key[i]) | {"is_default": configs[i].get("is_default", False)}
            for i in range(len(configs))] + errors
    base = next((r for r in rows if r.get("is_default") and r.get("s_per_round")), None)
    limit_s = flops / peak["flops"]
    rows.append({
        "implementation": "limit",
        "config": f"FLOPs / matmul peak ({peak['flops'] / 1e9:.0f} GFLOP/s)",
        "model": model,
        "s_per_round": {"median": limit_s, "min": limit_s, "max": limit_s},
        "rounds_per_hour": 3600 / limit_s,
    })
    for r in rows:
        s = r.get("s_per_round")
        if s:
            r["fraction_of_peak"] = flops / s["median"] / peak["flops"]
            if base:
                r["ratio_to_fedax"] = s["median"] / base["s_per_round"]["median"]

    result = {
        "model": model,
        "date": common.now_iso(),
        "workload": common.WORKLOAD,
        "flops_per_example": common.flops_per_example(model),
        "flops_per_round": flops,
        "matmul_peak": peak,
        "matmul_peak_before_after": [peak_before["flops"], peak_after["flops"]],
        "matmul_peak_one_core": single_core,
        "machine": common.machine_info(),
        "versions": common.versions("jax", "jaxlib", "optax", "torch", "flwr", "ray", "pfl",
                                    "fedax"),
        "rounds_per_config": total_rounds,
        "warmup_per_run": args.warmup,
        "passes": passes,
        "disturbed_threshold_cores": common.DISTURBED_CORES,
        "fedax_default": base["config"] if base else None,
        "results": rows,
    }
    out_dir = Path(args.out)
    out = common.dated_result(out_dir, model)
    common.write_json(out, result)
    update_summary(out_dir)
    print()
    print(common.text_table(rows))
    print(f"\nwrote {out} and {out_dir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
