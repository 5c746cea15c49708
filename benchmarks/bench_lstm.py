"""The Shakespeare char-LSTM's training step: fedax against PyTorch's ``nn.LSTM``, one run.

    .venv-bench/bin/python benchmarks/bench_lstm.py                   # B = 10, 3 passes
    .venv-bench/bin/python benchmarks/bench_lstm.py --batch 50 --json out.json

The model of McMahan et al. (2017) as ``fedax reproduce fedavg-shakespeare`` trains it: an
8-dimensional embedding of 98 symbols, two LSTM layers of 256 units, a dense softmax over
the symbols at each of the 80 positions, per-token cross-entropy, plain SGD. One step is
forward, backward and the parameter update on ``--batch`` sequences of 80 characters.

Implementations, each in its own subprocess (its own threads, nothing shared), alternated
in every pass with the order rotated:

- ``fedax``: ``fedax.client.local_train`` over ``--steps`` batches, compiled as ``fedax run``
  compiles a round of this model (``fedax.simulation.host.compiler_options`` with the
  model's ``MODEL_CPU_DOTS`` choice, YNNPACK products): what a client runs.
- ``fedax-eigen``: the same with fedax's CPU default for other models (Eigen products).
- ``fedax-plain-scan``: the same, with the LSTM written as a plain ``lax.scan`` of the
  cell and differentiated by JAX's autodiff (what one would write first; it is also how
  fedax's LSTM ran before the custom derivative and the fused gates).
- ``pytorch``: ``nn.Embedding`` -> ``nn.LSTM(8, 256, num_layers=2, batch_first=True)`` ->
  ``nn.Linear``, ``cross_entropy``, ``torch.optim.SGD``; ``torch.set_num_threads`` = all
  cores (oneDNN/MKL kernels of the CPU build). Skipped, and said so, without torch.

FLOPs per step (2 per multiply-add; backward = 2x forward, embedding lookups not counted)::

    3 * 2 * B * T * [4H(E + H) + 4H(2H) + H V]      (= 3.93 GFLOP at B = 10)

set against the machine's float32 matmul peak, measured in the same run
(``common.measure_matmul_peak``, all cores; ``--no-peak`` skips it). Prints ms per step,
GFLOP/s, % of the peak and each implementation's time over fedax's (> 1: slower than fedax).

``--device cuda``: PyTorch's model and batches on the GPU (``nn.LSTM`` runs cuDNN's LSTM),
each timed repeat ending in ``torch.cuda.synchronize()``; fedax runs on JAX's default
backend either way (the GPU where jaxlib has CUDA). The CPU's matmul peak means nothing
there: pass ``--no-peak``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

VOCAB, EMBED, HIDDEN, LAYERS, SEQ = 98, 8, 256, 2, 80
LR = 1.47  # the paper's Shakespeare learning rate
IMPLS = ("fedax", "fedax-eigen", "fedax-plain-scan", "pytorch")


def step_flops(batch: int) -> int:
    per_token = 4 * HIDDEN * (EMBED + HIDDEN) + 4 * HIDDEN * (2 * HIDDEN) + HIDDEN * VOCAB
    return 3 * 2 * batch * SEQ * per_token


def _data(steps: int, batch: int):
    import numpy as np

    rng = np.random.default_rng(common.SEED)
    x = rng.integers(1, VOCAB, (steps, batch, SEQ), dtype=np.int32)
    y = rng.integers(1, VOCAB, (steps, batch, SEQ), dtype=np.int32)
    return x, y


def _plain_apply(params, x):
    """The char-LSTM as a plain ``lax.scan`` of the cell (JAX autodiff, no custom rule)."""
    import jax
    import jax.numpy as jnp

    h_in = jnp.swapaxes(params["embed"][x], 0, 1)
    for k in range(LAYERS):
        cell = params[f"lstm_{k}"]

        def step(carry, x_t, cell=cell):
            h, c = carry
            z = x_t @ cell["w_x"] + h @ cell["w_h"] + cell["b"]
            zi, zf, zg, zo = jnp.split(z, 4, axis=-1)
            c = jax.nn.sigmoid(zf) * c + jax.nn.sigmoid(zi) * jnp.tanh(zg)
            h = jax.nn.sigmoid(zo) * jnp.tanh(c)
            return (h, c), h

        zeros = jnp.zeros((x.shape[0], HIDDEN))
        _, h_in = jax.lax.scan(step, (zeros, zeros), h_in)
    return jnp.swapaxes(h_in, 0, 1) @ params["out"]["kernel"] + params["out"]["bias"]


def _fedax_timer(impl: str, steps: int, batch: int):
    import jax
    import jax.numpy as jnp
    import optax

    from fedax.client import Batches, local_train
    from fedax.models import char_lstm
    from fedax.models.losses import token_cross_entropy
    from fedax.simulation.host import compiler_options, cpu_dots_for

    model = char_lstm(VOCAB, EMBED, HIDDEN, LAYERS)
    apply = _plain_apply if impl == "fedax-plain-scan" else model.apply
    dots = "eigen" if impl == "fedax-eigen" else cpu_dots_for("char_lstm")
    x, y = _data(steps, batch)
    batches = Batches(jnp.asarray(x), jnp.asarray(y), jnp.ones((steps, batch)))
    params = jax.jit(model.init)(jax.random.key(common.SEED))

    def loss(p, b):
        return token_cross_entropy(apply(p, b.x), b.y, b.mask)

    train = jax.jit(lambda p, b: local_train(loss, p, b, optax.sgd(LR)).params,
                    compiler_options=compiler_options(dots=dots)).lower(params, batches).compile()
    jax.block_until_ready(train(params, batches))

    def run():
        jax.block_until_ready(train(params, batches))

    return run


def _torch_timer(steps: int, batch: int, device: str = "cpu"):
    import torch

    torch.set_num_threads(common.num_cores())
    torch.manual_seed(common.SEED)

    class CharLSTM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, EMBED)
            self.lstm = torch.nn.LSTM(EMBED, HIDDEN, LAYERS, batch_first=True)
            self.out = torch.nn.Linear(HIDDEN, VOCAB)

        def forward(self, x):
            return self.out(self.lstm(self.embed(x))[0])

    model = CharLSTM().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data(steps, batch)
    xs, ys = torch.from_numpy(x).long().to(device), torch.from_numpy(y).long().to(device)

    def run():
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            logits = model(xs[s])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ys[s].reshape(-1))
            loss.backward()
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    run()
    return run


def worker(impl: str, steps: int, batch: int, repeats: int, device: str = "cpu") -> dict:
    if impl == "pytorch":
        run = _torch_timer(steps, batch, device)
    else:
        run = _fedax_timer(impl, steps, batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / steps)
    out = {"impl": impl, "ms_per_step": [1e3 * t for t in times]}
    if impl == "pytorch":
        out["device"] = device
        if device == "cuda":
            import torch

            out["device_name"] = torch.cuda.get_device_name()
            out["device_memory"] = {"peak_bytes_in_use": int(torch.cuda.max_memory_allocated())}
    else:
        out["device"] = common.jax_device_info()
        out["device_memory"] = common.jax_device_memory()
    return out


def _spawn(impl: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--batch",
           str(args.batch), "--steps", str(args.steps), "--repeats", str(args.repeats),
           "--device", args.device]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {impl}: skipped ({tail})", flush=True)
        return {"error": tail}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=10, help="B (the paper's: 10)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--only", default=",".join(IMPLS))
    parser.add_argument("--json", default=None, help="write the record here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where PyTorch runs (fedax: JAX's default backend)")
    parser.add_argument("--no-peak", action="store_true",
                        help="skip measuring the CPU's float32 matmul peak")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.batch, args.repeats,
                                args.device)))
        return 0

    impls = [i for i in args.only.split(",") if i]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {', '.join(IMPLS)}")
    peak = None if args.no_peak else common.measure_matmul_peak()
    samples: dict[str, list[float]] = {i: [] for i in impls}
    details: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for p in range(args.passes):
        order = impls[p % len(impls):] + impls[: p % len(impls)]
        print(f"pass {p + 1}/{args.passes}: {', '.join(order)}", flush=True)
        for impl in order:
            result = _spawn(impl, args)
            if "error" in result:
                skipped.setdefault(impl, result["error"])
            else:
                samples[impl].extend(result.pop("ms_per_step"))
                details[impl] = result
    flops = step_flops(args.batch)
    rows = []
    base = statistics.median(samples["fedax"]) if samples.get("fedax") else None
    peak_text = ("" if peak is None else
                 f"; float32 matmul peak {peak['flops'] / 1e9:.1f} GFLOP/s "
                 f"({common.num_cores()} cores)")
    print(f"\nB = {args.batch}, T = {SEQ}: {flops / 1e9:.2f} GFLOP a step{peak_text}")
    print(f"{'implementation':18} {'ms/step':>8} {'min':>7} {'GFLOP/s':>8} {'% peak':>7} "
          f"{'x fedax':>8}")
    for impl in impls:
        if not samples[impl]:
            continue
        ms = statistics.median(samples[impl])
        rate = flops / ms / 1e6
        fraction = None if peak is None else rate * 1e9 / peak["flops"]
        rows.append({"impl": impl, "ms_per_step_median": ms, "ms_per_step_min": min(samples[impl]),
                     "samples": samples[impl], "gflops_per_s": rate,
                     "fraction_of_peak": fraction,
                     "x_fedax": ms / base if base else None, **details.get(impl, {})})
        ratio = f"{ms / base:8.2f}" if base else " " * 8
        share = "      —" if fraction is None else f"{100 * fraction:6.1f}%"
        print(f"{impl:18} {ms:8.2f} {min(samples[impl]):7.2f} {rate:8.1f} {share} {ratio}")
    if args.json:
        common.write_json(args.json, {
            "comparison": "char_lstm_step", "batch": args.batch, "seq_len": SEQ,
            "model": {"vocab": VOCAB, "embed": EMBED, "hidden": HIDDEN, "layers": LAYERS},
            "step_gflop": flops / 1e9, "steps": args.steps, "repeats": args.repeats,
            "passes": args.passes, "device": args.device, "matmul_peak": peak, "rows": rows,
            "skipped": {k: v for k, v in skipped.items() if not samples[k]},
            "machine": common.machine_info(), "date": common.now_iso(),
            "versions": common.versions("jax", "jaxlib", "torch"),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
