"""The cost of a SecAgg+ round: fedax's protocol against a plain round and Flower's SecAgg+
workflow, in the same run, for the MNIST 2NN's 199,210 coordinates.

    .venv-bench/bin/python benchmarks/bench_secagg.py [--clients 10,50,100]
        [--dropouts 0,0.2] [--repeats 3] [--no-flower] [--out benchmarks/results/...]

For each number of clients n (all of them in the round) and drop-out fraction (clients
that drop after sharing their keys, before their masked vector: the case that costs the
server most, as in ``benchmarks/secagg_flower.py``):

* **fedax SecAgg+** (``fedax.runtime.secagg.run_round``, every message through its bytes):
  the server's seconds over the four stages (setup, key routing, share routing, unmasking),
  each client's seconds (key generation, Shamir sharing and encryption, masking, shares),
  the client's encoding (``fedax.federated.secure.encode_tree``: clip to [-8, 8], 2^22
  levels, 32 bits, Flower's defaults) and the bytes each way per client. One process,
  one thread: its seconds are CPU seconds on an idle machine.
* **plain round**: what the server does with n plain float32 updates in fedax's runtime
  (``fedax.runtime.wire``: each update decoded from its ``Tensor`` bytes, then summed), the
  client's encoding, and the bytes each way (the model down, the update up).
* **Flower SecAgg+** (``benchmarks/secagg_flower.py``: ``SecAggPlusWorkflow`` with
  ``secaggplus_mod`` in Flower's simulation engine, the same k, t, ranges and drop-outs):
  server process CPU, client CPU in the protocol, bytes each way per client, seconds a round.

It prints a table with the ratios and writes JSON (``--out``). The networked runtime's own
secure round (gRPC, TLS, authentication, deadlines) is measured by
``benchmarks/bench_secagg_network.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DIM = 199_210


def fedax_secagg(n: int, dropout: float, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from fedax.federated import SecureSum
    from fedax.federated import secure as sec
    from fedax.runtime.secagg import SecAggParams, default_num_shares, run_round
    from fedax.runtime.secagg.simulate import STAGES

    k = default_num_shares(n)
    t = k // 2 + 1
    spec = SecureSum(clip=8.0, bits=32, levels=2 ** 22 // n)
    rng = np.random.default_rng(0)
    updates = rng.normal(0, 0.01, size=(n, DIM)).astype(np.float32)
    keys = sec.client_keys(jax.random.key(0), n)
    encode = jax.jit(lambda x, key: sec.encode_tree(x, key, spec, n))
    encode(jnp.asarray(updates[0]), keys[0]).block_until_ready()  # compile
    start = time.perf_counter()
    inputs = {i: np.asarray(encode(jnp.asarray(updates[i]), keys[i])) for i in range(n)}
    encode_s = (time.perf_counter() - start) / n
    dropped = set(range(int(round(dropout * n))))
    rows = []
    for r in range(repeats):
        params = SecAggParams(num_clients=n, num_shares=k, threshold=t, bits=32, length=DIM,
                              session=f"bench {n} {r}".encode())
        total, transcript = run_round(inputs, params, drop={"share_keys": dropped},
                                      seed=r)
        survivors = [i for i in range(n) if i not in dropped]
        expected = sec.modular_sum_np(np.stack([inputs[i] for i in survivors]), 32)
        assert np.array_equal(total, expected), "the protocol's sum is wrong"
        up, down = transcript.bytes_per_client("up"), transcript.bytes_per_client("down")
        client_s = [sum(transcript.client_seconds[s].get(i, 0.0) for s in STAGES)
                    for i in range(n)]
        rows.append({
            "server_s": sum(transcript.server_seconds.values()),
            "server_stage_s": dict(transcript.server_seconds),
            "client_protocol_s_mean": statistics.fmean(client_s),
            "client_protocol_s_total": sum(client_s),
            "up_bytes_per_client": sum(sum(v.values()) for v in up.values()) / n,
            "down_bytes_per_client": sum(sum(v.values()) for v in down.values()) / n,
        })
    out = {key: statistics.median(r[key] for r in rows) for key in rows[0]
           if key != "server_stage_s"}
    out.update(num_shares=k, threshold=t, dropped=len(dropped), client_encode_s=encode_s,
               server_stage_s=rows[-1]["server_stage_s"])
    return out


def plain_round(n: int, repeats: int) -> dict:
    from fedax.runtime import wire

    rng = np.random.default_rng(0)
    updates = [{"update": rng.normal(0, 0.01, size=DIM).astype(np.float32)}
               for _ in range(n)]
    start = time.perf_counter()
    sent = [[t.SerializeToString() for t in wire.encode_tree(u)] for u in updates]
    client_s = (time.perf_counter() - start) / n
    layout = wire.expected_layout(updates[0])
    tensor_type = type(wire.encode_tree(updates[0])[0])
    times = []
    for _ in range(repeats):  # parse, check against the layout, sum
        start = time.perf_counter()
        total = np.zeros(DIM, np.float32)
        for pieces in sent:
            tensors = []
            for data in pieces:
                tensor = tensor_type()
                tensor.ParseFromString(data)
                tensors.append(tensor)
            total += wire.decode_arrays(tensors, layout, "update")[0]
        times.append(time.perf_counter() - start)
    size = sum(len(data) for data in sent[0])
    return {"server_s": statistics.median(times), "client_encode_s": client_s,
            "up_bytes_per_client": size, "down_bytes_per_client": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,50,100")
    parser.add_argument("--dropouts", default="0,0.2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-flower", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [int(c) for c in args.clients.split(",")]
    dropouts = [float(d) for d in args.dropouts.split(",")]
    results = []
    for n in sizes:
        plain = plain_round(n, args.repeats)
        for dropout in dropouts:
            row = {"num_clients": n, "dropout": dropout, "plain": plain,
                   "fedax": fedax_secagg(n, dropout, args.repeats)}
            # both rounds send the model down; SecAgg+ adds its messages
            row["fedax"]["down_bytes_per_client_with_model"] = (
                row["fedax"]["down_bytes_per_client"] + plain["down_bytes_per_client"])
            if not args.no_flower:
                from secagg_flower import flower_secagg_round

                row["flower"] = flower_secagg_round(
                    n, dropout, rounds=args.repeats, warmup=1,
                    num_shares=row["fedax"]["num_shares"],
                    threshold=row["fedax"]["threshold"])
            results.append(row)
            print(line(row), flush=True)
    record = {"benchmark": "SecAgg+ round cost, 2NN (199,210 coordinates)", "dim": DIM,
              "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
              "argv": sys.argv[1:], "results": results}
    out = Path(args.out or HERE / "results" / f"secagg-{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


def line(row: dict) -> str:
    f, p = row["fedax"], row["plain"]
    text = (f"n={row['num_clients']:4d} drop={row['dropout']:.0%}: fedax server "
            f"{f['server_s'] * 1e3:.0f} ms ({f['server_s'] / p['server_s']:.1f}x plain "
            f"{p['server_s'] * 1e3:.0f} ms), client {f['client_protocol_s_mean'] * 1e3:.0f} "
            f"ms + encode {f['client_encode_s'] * 1e3:.0f} ms, up "
            f"{f['up_bytes_per_client'] / 1e3:.0f} kB "
            f"({f['up_bytes_per_client'] / p['up_bytes_per_client']:.2f}x plain), down "
            f"{f['down_bytes_per_client_with_model'] / 1e3:.0f} kB "
            f"({f['down_bytes_per_client_with_model'] / p['down_bytes_per_client']:.3f}x)")
    fl = row.get("flower")
    if fl and not fl.get("skipped"):
        text += (f" | Flower server {fl['server_process_cpu_s']:.2f} s "
                 f"({fl['server_process_cpu_s'] / f['server_s']:.1f}x fedax), client "
                 f"{fl['client_protocol_cpu_s_total'] / row['num_clients'] * 1e3:.0f} ms, "
                 f"round {fl['median_round_s']:.2f} s, up "
                 f"{fl['up_bytes_per_client'] / 1e3:.0f} kB")
    elif fl:
        text += f" | Flower skipped: {fl.get('reason')}"
    return text


if __name__ == "__main__":
    main()
