"""The ``fedbuff`` paper (``papers/fedbuff.yaml``, ``hooks/fedbuff.py``): a tiny run of its
three methods on the virtual clock through the engine, whose FedAsync choice, comparison,
claims and report follow from the runs; the runs are reused, and ``--report-only``
rewrites the same report."""

from dataclasses import replace

import pytest

from fedax.reproduce import EXPERIMENTS, reproduce

PAPER = EXPERIMENTS["fedbuff"]
# MNIST, logistic regression, 20 clients, M = C = 4, K = 2, 24 client updates a run.
TINY = {"num_clients": 20, "model": "logistic", "concurrency": 4, "buffer_size": 2,
        "client_updates": 24, "eval_every_updates": 4, "seeds": [0], "targets": [0.3, 0.6],
        "fedasync_alphas": [0.3, 0.9]}


def _tables(text):
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.slow  # an end-to-end reproduction
def test_fedbuff_paper_runs_end_to_end(tmp_path):
    paper = replace(PAPER, settings={"common": PAPER.settings["common"], "quick": TINY})
    logs: list[str] = []
    results = reproduce(paper, tmp_path, quick=True, progress=False, log=logs.append)
    (seed,) = results["per_seed"]
    runs = [seed["sync"], seed["fedbuff"], *seed["fedasync"]]
    assert [r["name"] for r in runs] == ["seed0/sync", "seed0/fedbuff", "seed0/fedasync_a0.3",
                                         "seed0/fedasync_a0.9"]
    assert all((tmp_path / "runs" / f"{r['name']}.json").exists() for r in runs)
    for r in runs:  # every method ran the same number of client updates
        assert r["records"][-1]["client_updates"] == 24
    assert seed["sync"]["mean_staleness"] == 0 and seed["fedasync"][0]["mean_staleness"] > 0
    assert seed["fedbuff"]["setting"] == {"buffer_size": 2, "server_lr": 1.0}

    for k in ("0.3", "0.6"):
        hits = [r["to_target"][k] for r in seed["fedasync"]]
        best = min(range(2), key=lambda i: (
            float("inf") if hits[i]["client_updates"] is None else hits[i]["client_updates"],
            -seed["fedasync"][i]["best_accuracy"]))
        assert results["best_async"][k] == [best]
        c = results["comparison"][k]
        assert c["methods"]["fedasync"]["client_updates"] == hits[best]["client_updates"]
        sync, buff = seed["sync"]["to_target"][k], seed["fedbuff"]["to_target"][k]
        assert c["methods"]["sync"]["virtual_time"] == sync["virtual_time"]
        assert c["methods"]["fedbuff"]["reached"] == (buff["virtual_time"] is not None)
        if sync["virtual_time"] and buff["virtual_time"]:
            assert c["time_speedup_vs_sync"] == sync["virtual_time"] / buff["virtual_time"]
        faster = next(x for x in results["claims"] if x["claim"] ==
                      f"FedBuff reaches {float(k):.0%} faster in virtual time than "
                      "synchronous FedAvg")
        assert faster["held"] == (buff["virtual_time"] is not None and (
            sync["virtual_time"] is None or c["time_speedup_vs_sync"] > 1))
    assert len(results["claims"]) == 4

    report = (tmp_path / "report.md").read_text()
    assert "## Target 30%" in report and "## Target 60%" in report
    assert "|---|---:|---:|---:|" in report
    assert (f"| 0 | fedbuff | {seed['fedbuff']['final_accuracy']:.4f} | "
            f"{seed['fedbuff']['best_accuracy']:.4f} |") in report
    assert (tmp_path / "accuracy.png").stat().st_size > 1000

    logs.clear()
    again = reproduce(paper, tmp_path, quick=True, progress=False, log=logs.append)
    assert sum("reused" in line for line in logs) == 4
    assert again["comparison"] == results["comparison"]
    (tmp_path / "report.md").unlink()
    reproduce(paper, tmp_path, report_only=True, progress=False, log=logs.append)
    assert _tables((tmp_path / "report.md").read_text()) == _tables(report)
