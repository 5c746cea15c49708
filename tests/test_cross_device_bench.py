"""The cross-device comparison (benchmarks/cross_device.py, bench_cross_device_peers.py,
compare_cross_device.py): the population, the rounds every peer trains, the summary section,
and toy runs of the scripts. The peers need torch, Flower and pfl, which live in
``.venv-bench`` (``make bench-env``); without it only fedax's side runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_cross_device_peers as peers  # noqa: E402
import compare_cross_device as ccd  # noqa: E402
import cross_device as cd  # noqa: E402

BENCH_PYTHON = REPO / ".venv-bench" / "bin" / "python"
needs_bench_env = pytest.mark.skipif(not BENCH_PYTHON.exists(),
                                     reason="no .venv-bench (make bench-env)")


@pytest.fixture(scope="module")
def labels():
    from fedax.data import load_mnist

    return load_mnist()["y_train"]


@pytest.fixture(scope="module")
def full(labels):
    return cd.population(labels, cd.NUM_CLIENTS, cd.ALPHA, cd.SEED)


def test_population_is_deterministic_with_sizes_in_bounds_and_distinct_examples(labels, full):
    indices, offsets = full
    again = cd.population(labels, cd.NUM_CLIENTS, cd.ALPHA, cd.SEED)
    assert np.array_equal(indices, again[0]) and np.array_equal(offsets, again[1])
    other = cd.population(labels, cd.NUM_CLIENTS, cd.ALPHA, cd.SEED + 1)
    assert not np.array_equal(indices[:1000], other[0][:1000])

    sizes = np.diff(offsets)
    assert len(sizes) == cd.NUM_CLIENTS and offsets[0] == 0 and offsets[-1] == len(indices)
    assert sizes.min() == cd.MIN_SIZE and sizes.max() == cd.MAX_SIZE  # both clips bind
    assert 40 <= np.median(sizes) <= 50 and 45 <= sizes.mean() <= 55  # LogNormal(ln 45, .5)
    assert indices.min() >= 0 and indices.max() < len(labels)
    # within a client no example twice: sorted by (client, example), no equal neighbours
    owner = np.repeat(np.arange(cd.NUM_CLIENTS), sizes)
    order = np.lexsort((indices, owner))
    same = (owner[order][1:] == owner[order][:-1]) & (indices[order][1:] == indices[order][:-1])
    assert not same.any()
    # ... while across clients examples are shared (~500,000 draws from 60,000 images)
    assert len(np.unique(indices)) < len(indices) / 5


def test_class_counts_are_the_dirichlet_multinomial_draw(labels, full):
    indices, offsets = full
    sizes = np.diff(offsets)
    owner = np.repeat(np.arange(cd.NUM_CLIENTS), sizes)
    counts = np.zeros((cd.NUM_CLIENTS, 10), np.int64)
    np.add.at(counts, (owner, labels[indices]), 1)
    # the draw, replayed: sizes, then q_k ~ Dir(alpha), then Multinomial(n_k, q_k)
    rng = np.random.default_rng(cd.SEED)
    want_sizes = np.clip(rng.lognormal(np.log(cd.SIZE_MEDIAN), cd.SIZE_SIGMA,
                                       cd.NUM_CLIENTS).astype(np.int64), cd.MIN_SIZE, cd.MAX_SIZE)
    mix = rng.dirichlet(np.full(10, cd.ALPHA), cd.NUM_CLIENTS)
    assert np.array_equal(sizes, want_sizes)
    assert np.array_equal(counts, rng.multinomial(want_sizes, mix))
    # and what that means over 10,000 clients: each class about a tenth of all draws,
    # while a client is dominated by a few digits (IID would give a top share near 0.2)
    totals = counts.sum(0)
    assert np.all(np.abs(totals / totals.sum() - 0.1) < 0.01), totals
    top_share = (counts.max(1) / sizes).mean()
    assert 0.3 < top_share < 0.6, top_share  # 0.40 for this seed


@pytest.fixture(scope="module")
def small():
    return cd.load_population(300, cd.ALPHA, cd.SEED)[0]


def test_round_clients_are_the_runners_cohort_and_pfl_walks_the_same_batches(small):
    from fedax.data import sample_clients
    from fedax.simulation.sources import PartitionSource

    per_round, seed = 30, 3
    source = PartitionSource(small, per_round / small.num_clients, cd.LOCAL_EPOCHS,
                             cd.BATCH_SIZE, seed)
    sampler = peers.FedaxCohorts(small.num_clients, per_round, seed)
    for t in range(2):
        ids, clients = cd.round_clients(small, t, per_round, seed)
        rng = np.random.default_rng([seed, t])
        assert ids.tolist() == sorted(sample_clients(rng, small.num_clients, 0.1).tolist())
        assert len(ids) == per_round == len(set(ids.tolist()))
        # fedax's own round t: the same clients, and batch for batch the same examples
        data = source.round_data(t, per_round)
        (idx, mask), (num_examples, client_ids) = data.sharded, data.plain
        assert client_ids.tolist() == ids.tolist()
        for c, (n_k, batches) in enumerate(clients):
            k = int(ids[c])
            assert n_k == num_examples[c] == small.sizes[k]
            runner = [row[m > 0].tolist() for row, m in zip(idx[c], mask[c], strict=True)
                      if m.any()]
            assert [b.tolist() for b in batches] == runner
            assert [len(b) for b in batches] == [cd.BATCH_SIZE] * (len(batches) - 1) + [
                n_k - cd.BATCH_SIZE * (len(batches) - 1)]
            assert sorted(np.concatenate(batches)) == sorted(small.client_indices(k))
            # pfl's user t·N + k: those batches, in order, and its sampler draws them
            user = t * small.num_clients + k
            assert np.array_equal(peers.pfl_user_order(small, user, seed),
                                  np.concatenate(batches))
            assert peers.UserSizes(small.sizes)[user] == small.sizes[k]
        assert [sampler() for _ in range(per_round)] == (t * small.num_clients + ids).tolist()
    # Flower samples its own clients: a client's batches depend on (t, k) only
    ids, clients = cd.round_clients(small, 1, per_round, seed)
    _, [(n_k, alone)] = cd.round_clients(small, 1, 1, seed, client_ids=[ids[4]])
    assert n_k == clients[4][0] and [b.tolist() for b in alone] == [
        b.tolist() for b in clients[4][1]]


def _row(impl, config, cups=None, **extra):
    row = {"implementation": impl, "config": config, **extra}
    if cups:
        row.update(s_per_round={"median": 20 / cups, "min": 20 / cups, "max": 20 / cups},
                   client_updates_per_s=cups, rounds_total=2, rounds_kept=2,
                   peak_rss_mb=500.0, peak_pss_mb=400.0)
    return row


def _cells(text: str, first: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {first} "))
    return [c.strip() for c in line.split("|")[1:-1]]


def test_section_ratios_and_the_runs_that_did_not_fit():
    rows = [
        _row("fedax", "default (sequential:scan:2)", 400.0, is_default=True),
        _row("pytorch", "1 proc x 1 thread", 100.0),
        _row("flower", "1 cpu/client (2 concurrent)", passes=1, failed_passes=0,
             rounds_total=0, rounds_kept=0, peak_rss_mb=2500.0, cut_off=[{
                 "budget_s": 300.0, "rounds_done": 0, "rounds_planned": 3,
                 "phase": "warm-up", "in_round": 1, "round_running_s": 290.4,
                 "startup_s": 9.6}]),
        _row("pfl", "2 procs x 1 thread", error="timeout after 360 s"),
    ]
    ccd.add_ratios(rows)
    assert rows[0]["ratio_to_fedax"] == 1.0 and rows[1]["ratio_to_fedax"] == 4.0
    assert "ratio_to_fedax" not in rows[2]
    data = {"machine": {"cpu": "X", "cores": 2, "mem_total_gib": 8}, "clients": 10_000,
            "workload": {"20": {"alpha": 0.5, "sizes": {"min": 20, "max": 100, "mean": 50.0}}},
            "date": "today", "rounds_per_config": 2, "passes": 1, "warmup_per_run": 1,
            "budget_s": 300.0, "per_round": [20], "results": {"20": rows},
            "setup": peers.SETUP}
    text = ccd.section(data, "cross_device_x.json")
    head = next(x for x in text.splitlines() if x.startswith("| implementation"))
    assert [c.strip() for c in head.split("|")[1:-1]] == list(ccd.COLUMNS)
    assert _cells(text, "pytorch") == ["pytorch", "1 proc x 1 thread", "0.2", "0.2", "0.2",
                                       "100", "500", "400", "4.00", "2/2"]
    assert _cells(text, "fedax")[5:9] == ["400", "500", "400", "1.00"]
    assert _cells(text, "flower")[2] == "—" and _cells(text, "flower")[-1] == "0/0 (cut off)"
    assert _cells(text, "pfl")[-1] == "FAILED: timeout after 360 s"
    missed = text.split("Not run to the end within the bound:", 1)[1].split("Configurations")[0]
    assert "flower 1 cpu/client (2 concurrent): cut off at the 300 s bound after 0 of 3 " \
           "rounds (start-up 10 s); round 1 had run 290 s, so no measured round" in missed
    assert "- pfl 2 procs x 1 thread: timeout after 360 s\n" in missed + "\n"
    assert ccd.LIMITS["flower"] in missed  # what runs out as N and K grow
    assert "pytorch 1 proc x 1 thread" not in missed and "fedax" not in missed
    assert all(peers.SETUP[k] in text for k in ("fedax", "pytorch", "flower", "pfl"))


def test_the_section_replaces_only_itself(tmp_path):
    path = tmp_path / "summary.md"
    ccd.update_summary(path, "first")  # no file yet: the section alone
    assert path.read_text() == f"{ccd.BEGIN}\n\nfirst\n{ccd.END}\n"
    before, after = "# Title\n\nanalysis, kept\n", "\n## Later\n\nalso kept\n"
    path.write_text(before + f"{ccd.BEGIN}\nold\n{ccd.END}" + after)
    ccd.update_summary(path, "second")
    assert path.read_text() == before + f"{ccd.BEGIN}\n\nsecond\n{ccd.END}" + after
    path.write_text(before)  # no markers: appended
    ccd.update_summary(path, "third")
    assert path.read_text() == before + f"\n{ccd.BEGIN}\n\nthird\n{ccd.END}\n"


def _python() -> str:
    return str(BENCH_PYTHON) if BENCH_PYTHON.exists() else sys.executable


@pytest.mark.slow
def test_toy_comparison_writes_the_json_and_its_summary_section(tmp_path, child_env):
    out = tmp_path / "out"
    out.mkdir()
    kept = ("# fedax benchmarks\n\n<!-- compare.py: newest runs -->\nW's table\n"
            "<!-- /compare.py -->\n")
    (out / "summary.md").write_text(kept)
    done = subprocess.run(
        [_python(), str(BENCH / "compare_cross_device.py"), "--clients", "200",
         "--per-round", "20", "--rounds", "1", "--passes", "1", "--only", "fedax,pytorch",
         "--cooldown", "0", "--out", str(out)],
        env=child_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = out.glob("cross_device_*.json")
    data = json.loads(path.read_text())
    assert data["per_round"] == [20] and data["clients"] == 200
    assert data["workload"]["20"]["clients_per_round"] == 20
    rows = {(r["implementation"], r["config"]): r for r in data["results"]["20"]}
    fedax = next(r for (impl, _), r in rows.items() if impl == "fedax")
    assert fedax["config"].startswith("default (") and fedax["ratio_to_fedax"] == 1.0
    assert fedax["client_updates_per_s"] == pytest.approx(20 / fedax["s_per_round"]["median"])
    torch_rows = [r for (impl, _), r in rows.items() if impl == "pytorch"]
    if BENCH_PYTHON.exists():
        assert {r["config"] for r in torch_rows} >= {"1 proc x 1 thread", "2 procs x 1 thread"}
        for r in torch_rows:
            assert r["rounds_total"] == 1 and r["peak_rss_mb"] > 100
            assert math.isfinite(r["rounds"][0]["train_loss"])
            assert r["ratio_to_fedax"] == pytest.approx(
                fedax["client_updates_per_s"] / r["client_updates_per_s"])
    else:
        assert [r["error"] for r in torch_rows] == ["torch not installed here (make bench-env)"]

    text = (out / "summary.md").read_text()
    assert text.startswith(kept)  # the rest of the file untouched
    section = text[len(kept):]
    assert section.count(ccd.BEGIN) == 1 and section.rstrip().endswith(ccd.END)
    assert f"({path.name})" in section and "### 20 clients a round" in section
    assert "| " + " | ".join(ccd.COLUMNS) + " |" in section
    assert "| fedax | default (" in section and "Configurations: fedax:" in section


@needs_bench_env
def test_peers_train_the_same_batches_and_a_run_stops_at_its_budget(tmp_path, child_env):
    """pfl and the PyTorch loop train fedax's very batches from the same initial model:
    their training losses agree; Flower (its own sampling) learns too; a budget of 0 s
    leaves a record that says the run was cut off in its start-up."""
    losses = {}
    for impl, extra in (("pytorch", ["--threads", "1"]), ("pfl", ["--threads", "1"]),
                        ("flower", [])):
        out = tmp_path / f"{impl}.json"
        done = subprocess.run(
            [str(BENCH_PYTHON), str(BENCH / "bench_cross_device_peers.py"), impl,
             "--clients", "200", "--per-round", "20", "--rounds", "1", *extra,
             "--json", str(out)], env=child_env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        record = json.loads(out.read_text())
        assert record["workload"]["clients_per_round"] == 20 and "cut_off" not in record
        assert record["client_updates_per_s"] == pytest.approx(
            20 / record["s_per_round"]["median"])
        assert record["setup"] == peers.SETUP[impl]
        losses[impl] = [r["train_loss"] for r in record["rounds"]]
    assert losses["pfl"] == pytest.approx(losses["pytorch"], rel=1e-5)
    assert 0.5 < losses["flower"][0] < 2.3  # below ln 10: one round already learnt

    out = tmp_path / "cut.json"
    done = subprocess.run(
        [str(BENCH_PYTHON), str(BENCH / "bench_cross_device_peers.py"), "pytorch",
         "--clients", "200", "--per-round", "20", "--budget", "0", "--json", str(out)],
        env=child_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["cut_off"]["phase"] == "start-up" and record["cut_off"]["rounds_done"] == 0
    assert record["rounds"] == [] and "s_per_round" not in record


@pytest.mark.parametrize("cut_off", [True, False])
def test_a_cut_off_record_counts_though_the_run_then_failed(tmp_path, cut_off):
    """Flower's runtime exits 1 once the budget's thread has stopped its workers; the
    record that thread wrote first says the run was cut off, and the summary must say so,
    not "exit 1". Without a cut-off record, a failing run is an error."""
    import compare

    script = tmp_path / "peer.py"
    record = {"rounds": [], "cut_off": {"rounds_done": 1}} if cut_off else {"rounds": []}
    script.write_text(
        "import json, sys\n"
        f"json.dump({record!r}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
        "sys.exit(1)\n")
    config = {"script": str(script), "implementation": "flower", "label": "x", "args": []}
    got = compare.run_one(config, "2nn", 1, 0, tmp_path / "r.json", tmp_path / "r.log", 60)
    if cut_off:
        assert "error" not in got and got["cut_off"] == {"rounds_done": 1}
    else:
        assert got["error"] == "exit 1"


def test_a_result_of_the_same_day_is_never_replaced(tmp_path):
    """A benchmark run twice in a day writes a second file beside the first."""
    import common

    first = common.dated_result(tmp_path, "cross_device")
    first.write_text("{}\n")
    second = common.dated_result(tmp_path, "cross_device")
    second.write_text("{}\n")
    third = common.dated_result(tmp_path, "cross_device")
    assert len({first, second, third}) == 3
    assert second.name == first.name.replace(".json", "-2.json")
    assert third.name == first.name.replace(".json", "-3.json")
    assert first.read_text() == "{}\n"
