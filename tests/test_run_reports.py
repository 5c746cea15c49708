"""A run says what happened: through ``run_experiment`` on the tiny synthetic config, the
records in metrics.jsonl and summary.json carry a compressed uplink's bytes and ratio, and
an attack's attackers in each cohort and the robust rule's choice, against numbers
recomputed here (the message format by hand, the cohorts and attackers from their NumPy
draws)."""

from __future__ import annotations

import json
import math

import numpy as np
import yaml
from conftest import TINY_CONFIG

from fedax.experiments.run import run_experiment
from fedax.spec.config import validate_config

BASE = yaml.safe_load(TINY_CONFIG)  # 12 clients, 6 a round, 2 rounds, logistic 60 -> 10
LEAVES = (10, 600)  # the logistic model's bias and kernel: d = 610


def read(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())


def qsgd_code_bytes(levels, bucket_size=512):
    """QSGD's message by hand: per leaf of d coordinates, ⌈d/B⌉ buckets of B = min(512, d)
    (zero-padded), a float32 norm each, and ⌈log₂(2s+1)⌉-bit codes packed ⌊32/bits⌋ to a
    uint32 word."""
    bits = math.ceil(math.log2(2 * levels + 1))
    total = 0
    for d in LEAVES:
        size = min(bucket_size, d)
        buckets = -(-d // size)
        total += 4 * buckets + 4 * -(-(buckets * size) // (32 // bits))
    return total


def cohort(seed, t, num_clients=12, fraction=0.5):
    """Round t + 1's cohort: ``sample_clients`` with ``default_rng([seed, t])``."""
    m = math.floor(fraction * num_clients)
    return np.random.default_rng([seed, t]).choice(num_clients, size=m, replace=False)


def test_a_compressed_run_records_its_uplink_bytes_and_ratio(tmp_path):
    config = validate_config({**BASE, "compression": {"scheme": "qsgd", "levels": 4}})
    run_experiment(config, tmp_path, progress=False, tensorboard=False)
    records, summary = read(tmp_path)
    code = qsgd_code_bytes(4)
    assert code == (4 + 8) + (8 + 512)  # 4-bit codes: 8 a word; bias 1 bucket, kernel 2
    per_client, uncompressed = code + 4, 4 * sum(LEAVES) + 4  # + the float32 weight
    assert [r["round"] for r in records] == [1, 2]
    for r in records:  # every client of the 6 has data: all accepted
        assert r["uplink_bytes"] == 6 * per_client
        assert math.isclose(r["compression_ratio"], uncompressed / per_client, rel_tol=1e-6)
    assert summary["compression"] == {
        "scheme": "qsgd", "compressor": "qsgd(s=4)", "code_bytes_per_client": code,
        "bytes_per_client": per_client, "uncompressed_bytes_per_client": uncompressed,
        "compression_ratio": uncompressed / per_client,
        "uplink_bytes_total": 2 * 6 * per_client}
    assert summary["last_record"]["uplink_bytes"] == 6 * per_client


def test_a_private_compressed_run_counts_each_poisson_cohort(tmp_path):
    """DP-FedAvg over QSGD (``dp_compressed``) with Poisson sampling: each round's uplink is
    its drawn cohort's size times the message."""
    config = validate_config({**BASE, "compression": {"scheme": "qsgd", "levels": 4},
                              "privacy": {"mechanism": "gaussian", "clip": 1.0,
                                          "noise_multiplier": 1.0, "sampling": "poisson"}})
    run_experiment(config, tmp_path, progress=False, tensorboard=False)
    records, summary = read(tmp_path)
    per_client = qsgd_code_bytes(4) + 4
    drawn = [int((np.random.default_rng([0, t]).random(12) < 0.5).sum()) for t in range(2)]
    assert [r["uplink_bytes"] for r in records] == [n * per_client for n in drawn]
    assert summary["compression"]["uplink_bytes_total"] == sum(drawn) * per_client
    assert summary["compression"]["bytes_per_client"] == per_client
    assert "clipped_clients" in records[-1]


def test_an_attacked_krum_run_records_its_attackers_and_krums_choice(tmp_path):
    config = validate_config({**BASE, "attack": {"kind": "sign_flip", "fraction": 0.25},
                              "robust": {"rule": "krum", "byzantine": 1}})
    run_experiment(config, tmp_path, progress=False, tensorboard=False)
    records, summary = read(tmp_path)
    # choose_attackers: round(0.25 · 12) = 3 ids from default_rng([seed, "atta"])
    attackers = np.sort(np.random.default_rng([0, 0x61747461]).choice(12, 3, replace=False))
    assert summary["attack"]["attackers"] == attackers.tolist()
    in_cohort = [int(np.isin(cohort(0, t), attackers).sum()) for t in range(2)]
    assert sum(in_cohort) >= 1  # the test means something: an attacker was sampled
    for r, n in zip(records, in_cohort, strict=True):
        assert r["attackers_in_cohort"] == n
        assert r["krum_discarded"] == 6 - 1  # Krum keeps one of the 6
        assert r["attackers_selected"] in range(min(n, 1) + 1)
    assert summary["attack"]["attackers_in_cohort_total"] == sum(in_cohort)
    assert summary["attack"]["attackers_selected_total"] == sum(
        r["attackers_selected"] for r in records)
    assert summary["last_record"]["attackers_in_cohort"] == in_cohort[-1]
    assert "compression" not in summary
