"""Where a local step's time goes: XLA:CPU's per-operation profile of one client's steps.

    taskset -c 0 python benchmarks/profile_step.py cnn --steps 30 --json out.json
    taskset -c 0 python benchmarks/profile_step.py 2nn --steps 60
    python benchmarks/profile_step.py char_lstm --steps 10       # the Shakespeare LSTM

``char_lstm`` is the Shakespeare model of ``fedax reproduce fedavg-shakespeare`` (98
symbols, two LSTM layers of 256) on B = 10 random sequences of 80 characters, with the
per-token cross-entropy the runner trains it with.

One client's W local steps (B = 10, SGD, ``fedax.client.local_train``) compiled as the
runner compiles them (``compiler_options``), run once untraced to time the step, then under
``jax.profiler`` with XLA's per-operation trace events. Each compiled operation (a
convolution, a product, a fusion) is listed with its milliseconds per step, its share of
the step, what it computes (the HLO instruction, and the JAX operation it came from:
``jvp`` is the forward pass, ``transpose(jvp)`` the backward pass), and for products and
convolutions their FLOPs and GFLOP/s, to set against the matmul peak of one core that the
script measures (``--peak``). Pin it to one core, as the ``processes`` workers are.
Tracing adds a little time per operation: the profiled total exceeds the untraced step.
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def parse_hlo(text: str) -> tuple[dict, dict]:
    """(instructions, computations) of an optimized HLO module's text: name ->
    (dtype, shape, opcode, rest of line); computation -> its instruction names."""
    instructions, computations, current = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        m = _DEF.match(line)
        if m:
            name, dtype, dims, opcode, rest = m.groups()
            instructions[name] = (dtype, _dims(dims), opcode, rest)
            computations[current].append(name)
            continue
        m = _COMP.match(line)
        if m:
            current = m.group(1)
    return instructions, computations


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def flops(name: str, instructions: dict, computations: dict) -> int:
    """FLOPs (2 per multiply-add) of the products and convolutions in instruction ``name``
    (inside a fusion: in the computation it calls)."""
    _, shape, opcode, rest = instructions[name]
    if opcode == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = computations.get(called.group(1), []) if called else []
        return sum(flops(n, instructions, computations) for n in body)
    out = math.prod(shape)
    ops = _operands(rest)
    if opcode == "dot" and ops:
        lhs = instructions.get(ops[0])
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        if lhs and dims:
            return 2 * out * math.prod(lhs[1][d] for d in _dims(dims.group(1)))
    if opcode == "convolution" and len(ops) == 2:
        kernel = instructions.get(ops[1])
        labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
        window = re.search(r"size=([\dx]+)", rest)
        if kernel and labels and window:
            in_features = kernel[1][labels.group(1).index("i")]
            taps = math.prod(int(s) for s in window.group(1).split("x"))
            return 2 * out * taps * in_features
    return 0


def origin(rest: str) -> str:
    """The JAX operation an instruction came from, from its metadata."""
    m = re.search(r'op_name="([^"]*)"', rest)
    if not m:
        return ""
    path = m.group(1)
    path = re.sub(r"^jit\([^)]*\)/", "", path)
    path = re.sub(r"^(while/body/)?(closed_call/)?(cond/branch_\d+_fun/)?", "", path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=[*common.MODELS, "char_lstm"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=common.BATCH_SIZE, help="B (W: 10)")
    parser.add_argument("--reps", type=int, default=3, help="profiled runs of the steps")
    parser.add_argument("--top", type=int, default=15, help="operations listed")
    parser.add_argument("--peak", type=float, default=None,
                        help="one core's float32 matmul peak in GFLOP/s (default: measured)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_enable_xprof_traceme=true")

    import jax
    import jax.numpy as jnp
    import optax
    from jax.profiler import ProfileData

    from fedax.client import Batches, local_train
    from fedax.models import char_lstm, get_model, softmax_cross_entropy
    from fedax.models.losses import token_cross_entropy
    from fedax.simulation.host import compiler_options

    peak = args.peak or common.measure_matmul_peak(threads=1)["flops"] / 1e9
    keys = jax.random.split(jax.random.key(common.SEED), 3)
    if args.model == "char_lstm":
        from fedax.data.shakespeare import VOCAB_SIZE

        model = char_lstm(VOCAB_SIZE)
        shape = (args.steps, args.batch, 80)  # the paper's 80-character samples
        x = jax.random.randint(keys[0], shape, 1, VOCAB_SIZE)
        y = jax.random.randint(keys[1], shape, 1, VOCAB_SIZE)

        def loss(p, b):
            return token_cross_entropy(model.apply(p, b.x), b.y, b.mask)
    else:
        model = get_model(args.model)
        x = jax.random.uniform(keys[0], (args.steps, args.batch, 28, 28, 1))
        y = jax.random.randint(keys[1], (args.steps, args.batch), 0, 10)

        def loss(p, b):
            return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)
    batches = Batches(x, y, jnp.ones((args.steps, args.batch)))
    params = jax.jit(model.init)(keys[2])

    train = jax.jit(lambda p, b: local_train(loss, p, b, optax.sgd(common.CLIENT_LR)).params,
                    compiler_options=compiler_options())
    compiled = train.lower(params, batches).compile()
    instructions, computations = parse_hlo(compiled.as_text())
    jax.block_until_ready(compiled(params, batches))
    untraced = []
    for _ in range(args.reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, batches))
        untraced.append((time.perf_counter() - start) / args.steps)
    step_ms = 1e3 * sorted(untraced)[len(untraced) // 2]

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.reps):
            jax.block_until_ready(compiled(params, batches))
        jax.profiler.stop_trace()
        path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
        profile = ProfileData.from_file(path)
        total_ns = collections.Counter()
        for plane in profile.planes:
            for line in plane.lines:
                for event in line.events:
                    if event.name in instructions:
                        total_ns[event.name] += event.duration_ns

    per_step = args.reps * args.steps
    # Control flow (the step loop, its branch) contains the other operations' time.
    containers = {n for n in total_ns if instructions[n][2] in ("while", "conditional", "call")}
    leaves = {n: ns / per_step / 1e6 for n, ns in total_ns.items() if n not in containers}
    profiled_ms = sum(leaves.values())
    rows = []
    for name, ms in sorted(leaves.items(), key=lambda kv: -kv[1]):
        dtype, shape, opcode, rest = instructions[name]
        f = flops(name, instructions, computations)
        rows.append({
            "op": name, "opcode": opcode, "shape": f"{dtype}{shape}", "from": origin(rest),
            "ms_per_step": ms, "share": ms / profiled_ms,
            "gflop": f / 1e9, "gflops_per_s": f / ms / 1e6 if f and ms else None,
        })
    matmul_ms = sum(r["ms_per_step"] for r in rows if r["gflop"])
    step_gflop = sum(r["gflop"] for r in rows)
    print(f"{args.model}: {step_ms:.3f} ms/step untraced, {profiled_ms:.3f} ms/step profiled "
          f"({len(leaves)} operations); products and convolutions {matmul_ms:.3f} ms "
          f"({100 * matmul_ms / profiled_ms:.0f}%) for {step_gflop:.3f} GFLOP; one core's "
          f"matmul peak {peak:.1f} GFLOP/s; at the peak the step would take "
          f"{1e3 * step_gflop / peak:.3f} ms")
    print(f"{'ms/step':>8} {'share':>6} {'GFLOP/s':>8}  {'op':24} {'shape':22} from")
    for r in rows[: args.top]:
        rate = f"{r['gflops_per_s']:8.1f}" if r["gflops_per_s"] else " " * 8
        print(f"{r['ms_per_step']:8.3f} {100 * r['share']:5.1f}% {rate}  {r['op'][:24]:24} "
              f"{r['shape'][:22]:22} {r['from'][:70]}")
    if args.json:
        common.write_json(args.json, {
            "comparison": "step_profile", "model": args.model, "steps": args.steps,
            "reps": args.reps, "untraced_ms_per_step": step_ms,
            "profiled_ms_per_step": profiled_ms, "step_gflop": step_gflop,
            "core_matmul_peak_gflops": peak, "operations": rows,
            "machine": common.machine_info(), "date": common.now_iso(),
            "versions": {"jax": jax.__version__},
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
