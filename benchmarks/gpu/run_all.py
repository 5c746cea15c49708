"""The parts of a GPU run, each in its own processes under its own time limit (run by
``run.sh``; see ``benchmarks/gpu/README.md``).

    python benchmarks/gpu/run_all.py OUT_DIR [--smoke] [--work DIR] [--budget S]

Parts, in order: ``machine`` (``run.json``), ``w_2nn`` and ``w_cnn`` (workload W, fedax
against PyTorch on the same device), ``lstm`` (the char-LSTM step; then Shakespeare clients
one after another against lockstep groups), ``cross_device`` (10,000
small clients, 1,000 and 10,000 a round) and ``shakespeare`` (the FedAvg and FedSGD cells,
continued for the time left). Each part's JSON is written into OUT_DIR as soon as it has
something and rewritten as it goes, so a part cut off by its limit (or the whole run cut
off) still leaves what it measured; ``run.json`` says each part's status. OUT_DIR gets at
most 8 files (the device tool brings back no more): the six JSON files, ``run.log`` (every
process's output) and ``shakespeare_runs.tar.gz`` (the continued cells' newest checkpoints
and metrics); everything else lives in ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
sys.path.insert(0, str(BENCH))
import common  # noqa: E402

PYTHON = sys.executable

# Seconds each part may take on the GPU (the shakespeare part gets what is left of the
# total); --smoke uses SMOKE_LIMITS. The total is 8 minutes less a margin for packing up.
GPU_TOTAL = 470.0
GPU_LIMITS = {"machine": 45, "w_2nn": 80, "w_cnn": 100, "lstm": 110, "cross_device": 80}
SMOKE_TOTAL = 170.0
SMOKE_LIMITS = {"machine": 30, "w_2nn": 30, "w_cnn": 40, "lstm": 60, "cross_device": 30}
PARTS = ("machine", "w_2nn", "w_cnn", "lstm", "cross_device", "shakespeare")


class Runner:
    """Starts each process of the run with a time limit, its output appended to run.log."""

    def __init__(self, out: Path, work: Path, smoke: bool, deadline: float):
        self.out, self.work, self.smoke, self.deadline = out, work, smoke, deadline
        self.log = out / "run.log"
        self.env = dict(os.environ)
        if smoke:
            self.env["FEDAX_BENCH_SMOKE"] = "1"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def call(self, argv: list[str], limit: float, env: dict[str, str] | None = None
             ) -> dict[str, Any]:
        """Run ``argv`` for at most ``limit`` seconds (its whole process group killed then);
        returns ``{"returncode" or "timeout", "wall_s", "stdout_tail"}``."""
        limit = max(1.0, min(limit, self.left()))
        started = time.monotonic()
        with open(self.log, "a") as log:
            log.write(f"\n===== {time.strftime('%H:%M:%S')} (limit {limit:.0f} s) "
                      f"{' '.join(argv)}\n")
            log.flush()
            with tempfile.TemporaryFile("w+") as captured:
                proc = subprocess.Popen(argv, stdout=captured, stderr=subprocess.STDOUT,
                                        env=env or self.env, start_new_session=True, text=True)
                timed_out = False
                try:
                    proc.wait(timeout=limit)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                captured.seek(0)
                text = captured.read()
            log.write(text)
            log.write(f"===== {'timed out' if timed_out else f'exit {proc.returncode}'} "
                      f"after {time.monotonic() - started:.1f} s\n")
        result: dict[str, Any] = {"wall_s": time.monotonic() - started,
                                  "stdout": text}
        if timed_out:
            result["timeout"] = limit
        else:
            result["returncode"] = proc.returncode
        return result


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _status(result: dict[str, Any]) -> str:
    if "timeout" in result:
        return f"timed out after {result['timeout']:.0f} s"
    return "ok" if result["returncode"] == 0 else f"exit {result['returncode']}"


# ----------------------------------------------------------------------------- parts
def part_machine(r: Runner, limit: float) -> dict[str, Any]:
    env = dict(r.env, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    result = r.call([PYTHON, str(HERE / "machine.py")], limit, env=env)
    lines = result["stdout"].strip().splitlines()
    try:
        machine = json.loads(lines[-1])
    except (IndexError, ValueError):
        machine = {"error": _status(result), "output_tail": _tail(result["stdout"])}
    return {"machine": machine, "status": _status(result), "wall_s": result["wall_s"]}


def _backend(machine: dict[str, Any]) -> str:
    return (machine.get("jax") or {}).get("backend", "cpu")


def _torch(machine: dict[str, Any]) -> tuple[bool, str, str]:
    """(torch usable, its device, why not) from the machine description."""
    torch = machine.get("torch") or {}
    if not torch.get("available"):
        return False, "cpu", torch.get("why", "torch is not importable")
    return True, ("cuda" if torch.get("cuda_available") else "cpu"), ""


def part_w(r: Runner, model: str, limit: float, machine: dict[str, Any]) -> dict[str, Any]:
    """Workload W for ``model``: fedax (default, then on an accelerator also the sequential
    strategy) and the hand-written PyTorch loop on the same device."""
    backend = _backend(machine)
    ok, device, why = _torch(machine)
    rounds = 1 if r.smoke else {"2nn": 5, "cnn": 3}[model]
    strategies = ["default"]
    if backend != "cpu":
        strategies.append("sequential:scan:1")  # the default there is vmap:scan:1
    elif r.smoke and model == "cnn":
        strategies = ["sequential:scan:1"]  # the CPU default (worker processes) starts slowly
    configs: list[tuple[str, list[str]]] = [
        (f"fedax {strategies[0]}", ["bench_fedax.py", model, "--strategy", strategies[0]])]
    skipped = []
    if ok:
        configs.append((f"pytorch {device}", ["bench_torch.py", model, "--procs", "1",
                                             "--device", device]))
    else:
        skipped.append({"implementation": "pytorch", "why": why})
    configs += [(f"fedax {s}", ["bench_fedax.py", model, "--strategy", s])
                for s in strategies[1:]]
    part: dict[str, Any] = {
        "part": f"w_{model}", "model": model, "backend": backend, "torch_device": device,
        "measured_rounds": rounds, "warmup_rounds": 1,
        "flops_per_round": common.flops_per_round(model),
        "runs": [], "failed": [], "skipped": skipped, "date": common.now_iso(),
    }
    out = r.out / f"w_{model}.json"
    part_deadline = time.monotonic() + limit
    for i, (label, argv) in enumerate(configs):
        left = part_deadline - time.monotonic()
        if left < 5:
            part["failed"].append({"config": label, "error": "not run: the part's time is up"})
            continue
        share = min(left, 1.5 * left / (len(configs) - i))
        json_path = r.work / f"w_{model}_{i}.json"
        json_path.unlink(missing_ok=True)
        result = r.call([PYTHON, str(BENCH / argv[0]), *argv[1:], "--rounds", str(rounds),
                         "--warmup", "1", "--json", str(json_path)], share)
        if json_path.exists():
            record = json.loads(json_path.read_text())
            record.pop("machine", None)
            record["wall_s"] = result["wall_s"]
            part["workload"] = record.pop("workload", None)
            if part["workload"]:  # the smoke's toy sizes do fewer FLOPs
                part["flops_per_round"] = (part["workload"]["examples_per_round"]
                                           * common.flops_per_example(model)["total"])
            part["runs"].append(record)
        else:
            part["failed"].append({"config": label, "error": _status(result),
                                   "output_tail": _tail(result["stdout"])})
        _ratios(part)
        common.write_json(out, part)
    return part


def _ratios(part: dict[str, Any]) -> None:
    """Each run's median over fedax's default's (> 1: slower than fedax's default)."""
    base = next((x for x in part["runs"] if x["implementation"] == "fedax"
                 and x["config"].startswith("default") and x.get("s_per_round")), None)
    rows = []
    for x in part["runs"]:
        s = (x.get("s_per_round") or {}).get("median")
        memory = (x.get("device_memory") or {}).get("peak_bytes_in_use")
        rows.append({"implementation": x["implementation"], "config": x["config"],
                     "s_per_round_median": s,
                     "tflops_per_s": part["flops_per_round"] / s / 1e12 if s else None,
                     "x_fedax_default": s / base["s_per_round"]["median"] if s and base
                     else None,
                     "peak_device_bytes": memory, "peak_rss_mb": x.get("peak_rss_mb")})
    part["summary"] = rows


def part_lstm(r: Runner, limit: float, machine: dict[str, Any]) -> dict[str, Any]:
    """``bench_lstm.py`` once per implementation (each its own process and time limit):
    fedax, PyTorch's ``nn.LSTM`` on the same device, fedax's LSTM as a plain ``lax.scan``."""
    ok, device, why = _torch(machine)
    impls = ["fedax"]
    if ok:
        impls.append("pytorch")
    if not r.smoke:
        impls.append("fedax-plain-scan")
    sizes = (["--steps", "2", "--repeats", "1"] if r.smoke
             else ["--steps", "20", "--repeats", "5"])
    part: dict[str, Any] = {"part": "lstm", "torch_device": device, "rows": [], "failed": [],
                            "skipped": {} if ok else {"pytorch": why},
                            "date": common.now_iso()}
    out = r.out / "lstm.json"
    part_deadline = time.monotonic() + limit
    for i, impl in enumerate(impls):
        left = part_deadline - time.monotonic()
        if left < 5:
            part["failed"].append({"impl": impl, "error": "not run: the part's time is up"})
            continue
        json_path = r.work / f"lstm_{impl}.json"
        json_path.unlink(missing_ok=True)
        result = r.call([PYTHON, str(BENCH / "bench_lstm.py"), "--only", impl, "--device",
                         device, "--no-peak", "--passes", "1", *sizes, "--json",
                         str(json_path)], min(left, 1.5 * left / (len(impls) - i)))
        record = json.loads(json_path.read_text()) if json_path.exists() else {}
        if record.get("rows"):
            for key in ("comparison", "batch", "seq_len", "model", "step_gflop", "steps",
                        "repeats", "versions"):
                part.setdefault(key, record.get(key))
            row = record["rows"][0]
            row["wall_s"] = result["wall_s"]
            part["rows"].append(row)
        else:
            error = (record.get("skipped") or {}).get(impl) or _status(result)
            part["failed"].append({"impl": impl, "error": error,
                                   "output_tail": _tail(result["stdout"])})
        base = next((x["ms_per_step_median"] for x in part["rows"] if x["impl"] == "fedax"),
                    None)
        for x in part["rows"]:
            x["x_fedax"] = x["ms_per_step_median"] / base if base else None
        common.write_json(out, part)
    part["lockstep"] = _lockstep(r, part_deadline - time.monotonic())
    if part["lockstep"].get("error"):
        part["failed"].append({"impl": "lockstep", "error": part["lockstep"]["error"]})
    common.write_json(out, part)
    return part


def _lockstep(r: Runner, left: float) -> dict[str, Any]:
    """``bench_lockstep.py`` on one device: the Shakespeare round's clients one after another
    (``sequential``) against lockstep groups of 16 (the form meant for accelerators), on 40
    clients (round 0's cohort of 400 roles, E = 5); into ``lstm.json`` (the run brings
    back at most 8 files)."""
    if left < 10:
        return {"error": "not run: the part's time is up"}
    json_path = r.work / "lockstep.json"
    json_path.unlink(missing_ok=True)
    sizes = (["--max-clients", "20", "--epochs", "1", "--rounds", "1", "--width", "2"]
             if r.smoke else ["--max-clients", "400", "--rounds", "2"])
    result = r.call([PYTHON, str(BENCH / "bench_lockstep.py"), *sizes, "--no-busy",
                     "--json", str(json_path)], left)
    if not json_path.exists():
        return {"error": _status(result), "output_tail": _tail(result["stdout"])}
    record = json.loads(json_path.read_text())
    record.pop("machine", None)
    record["wall_s"] = result["wall_s"]
    return record


def part_cross_device(r: Runner, limit: float, machine: dict[str, Any]) -> dict[str, Any]:
    if r.smoke:
        clients, sizes, rounds = 200, (20, 200), 1
    else:
        clients, sizes, rounds = 10_000, (1_000, 10_000), 5
    part: dict[str, Any] = {"part": "cross_device", "num_clients": clients,
                            "clients_per_round": list(sizes), "measured_rounds": rounds,
                            "warmup_rounds": 1, "backend": _backend(machine),
                            "runs": [], "failed": [], "date": common.now_iso()}
    out = r.out / "cross_device.json"
    part_deadline = time.monotonic() + limit
    for i, per_round in enumerate(sizes):
        left = part_deadline - time.monotonic()
        if left < 5:
            part["failed"].append({"clients_per_round": per_round,
                                   "error": "not run: the part's time is up"})
            continue
        json_path = r.work / f"cross_device_{per_round}.json"
        json_path.unlink(missing_ok=True)
        result = r.call([PYTHON, str(HERE / "cross_device.py"), "--clients", str(clients),
                         "--per-round", str(per_round), "--rounds", str(rounds),
                         "--warmup", "1", "--json", str(json_path)],
                        min(left, 1.5 * left / (len(sizes) - i)))
        if json_path.exists():
            record = json.loads(json_path.read_text())
            record.pop("machine", None)
            record["wall_s"] = result["wall_s"]
            part["runs"].append(record)
        else:
            part["failed"].append({"clients_per_round": per_round, "error": _status(result),
                                   "output_tail": _tail(result["stdout"])})
        part["summary"] = [
            {"clients_per_round": x["workload"]["clients_per_round"], "config": x["config"],
             "s_per_round_median": (x.get("s_per_round") or {}).get("median"),
             "client_updates_per_s": x.get("client_updates_per_s"),
             "examples_per_s": x.get("examples_per_s"),
             "peak_device_bytes": (x.get("device_memory") or {}).get("peak_bytes_in_use"),
             "peak_rss_mb": x.get("peak_rss_mb")} for x in part["runs"]]
        common.write_json(out, part)
    return part


def part_shakespeare(r: Runner, limit: float, machine: dict[str, Any],
                     cells: str | None) -> dict[str, Any]:
    json_path = r.out / "shakespeare.json"
    work = r.work / "shakespeare"
    argv = [PYTHON, str(HERE / "shakespeare.py"), "--work", str(work),
            "--budget", f"{max(limit - 15, 1):.0f}", "--json", str(json_path)]
    if r.smoke:
        argv.append("--smoke")
    if cells:
        argv += ["--cells", cells]
    result = r.call(argv, limit + 30)  # its own clock stops it; this is the backstop
    part = json.loads(json_path.read_text()) if json_path.exists() else {"part": "shakespeare"}
    last = {c["cell"]: c for c in part.get("cells", [])}  # a retried cell: its last attempt
    part["failed"] = [name for name, c in last.items() if c.get("status") == "error"]
    if "returncode" not in result or result["returncode"] != 0:
        part.update(error=_status(result), output_tail=_tail(result["stdout"]))
    common.write_json(json_path, part)
    _pack_runs(work, r.out / "shakespeare_runs.tar.gz")
    return part


def _pack_runs(work: Path, tarball: Path) -> None:
    """The cells' run directories, newest checkpoint only (the device tool brings back
    files of up to 16 MiB), as one tarball."""
    if not work.exists():
        return
    with tarfile.open(tarball, "w:gz") as tar:
        for run_dir in sorted(p.parent for p in work.glob("*/*/metrics.jsonl")):
            for path in sorted(run_dir.iterdir()):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(work)))
            checkpoints = sorted(run_dir.glob("checkpoints/ckpt_*.msgpack"),
                                 key=lambda p: int(p.stem.split("_")[1]))
            if checkpoints:
                tar.add(checkpoints[-1], arcname=str(checkpoints[-1].relative_to(work)))


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="OUT_DIR: the JSON files, run.log and the tarball")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (CPU)")
    parser.add_argument("--work", default=None,
                        help="scratch (default: a new folder under the system's temp dir)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {GPU_TOTAL:.0f}, "
                             f"smoke {SMOKE_TOTAL:.0f}), counted from run.sh's start")
    parser.add_argument("--only", default=None, help="comma-separated parts (machine always)")
    parser.add_argument("--shakespeare-cells", default=None,
                        help="comma-separated cells (default: see shakespeare.py)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="fedax-gpu-work-"))
    work.mkdir(parents=True, exist_ok=True)
    total = args.budget or (SMOKE_TOTAL if args.smoke else GPU_TOTAL)
    limits = SMOKE_LIMITS if args.smoke else GPU_LIMITS
    # run.sh's start (the install step counts against the budget too)
    spent = time.time() - float(os.environ.get("FEDAX_GPU_RUN_STARTED", time.time()))
    deadline = time.monotonic() + total - max(spent, 0.0)
    r = Runner(out, work, args.smoke, deadline)
    only = set(args.only.split(",")) if args.only else set(PARTS)
    unknown = only - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown parts {sorted(unknown)}; parts: {', '.join(PARTS)}")

    run_json: dict[str, Any] = {
        "mode": "smoke" if args.smoke else "gpu", "started": common.now_iso(),
        "budget_s": total, "spent_before_parts_s": spent, "work": str(work),
        "limits_s": limits, "parts": {}}
    install = os.environ.get("FEDAX_GPU_INSTALL_REPORT")
    if install and Path(install).exists():
        run_json["install"] = json.loads(Path(install).read_text())
    elif args.smoke:
        run_json["install"] = {"skipped": "smoke mode uses the current Python as it is"}
    started = time.monotonic()

    def save():
        run_json["wall_s"] = time.monotonic() - started + max(spent, 0.0)
        common.write_json(out / "run.json", run_json)

    machine_part = part_machine(r, limits["machine"])
    machine = machine_part.pop("machine")
    run_json["machine"] = machine
    run_json["parts"]["machine"] = machine_part
    save()
    print(f"machine: jax backend {_backend(machine)}, torch "
          f"{_torch(machine)[1] if _torch(machine)[0] else 'absent'}", flush=True)

    plan = [("w_2nn", lambda lim: part_w(r, "2nn", lim, machine)),
            ("w_cnn", lambda lim: part_w(r, "cnn", lim, machine)),
            ("lstm", lambda lim: part_lstm(r, lim, machine)),
            ("cross_device", lambda lim: part_cross_device(r, lim, machine)),
            ("shakespeare", lambda lim: part_shakespeare(r, lim, machine,
                                                         args.shakespeare_cells))]
    for name, run_part in plan:
        if name not in only:
            run_json["parts"][name] = {"status": "not asked for (--only)"}
            save()
            continue
        left = r.left()
        limit = left if name == "shakespeare" else min(limits[name], left)
        if limit < 10:
            run_json["parts"][name] = {"status": "not run: the run's time is up"}
            save()
            continue
        run_json["parts"][name] = {"status": "running", "limit_s": limit}
        save()
        t0 = time.monotonic()
        try:
            part = run_part(limit)
            failed = part.get("failed") or part.get("error")
            status = "ok" if not failed else "partial"
        except Exception as err:  # a broken part must not cost the others
            part, status = {}, f"error: {type(err).__name__}: {err}"
        run_json["parts"][name] = {"status": status, "limit_s": limit,
                                   "wall_s": time.monotonic() - t0,
                                   "file": f"{name}.json" if part else None}
        save()
        print(f"{name}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
    run_json["finished"] = common.now_iso()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
