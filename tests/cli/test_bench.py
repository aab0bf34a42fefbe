"""Smoke run of ``ringmpi bench``: tiny sizes, P = 1 and 2, JSON fields and sane values."""

from __future__ import annotations

import json
import math

import pytest

from ringmpi.cli import bench


@pytest.mark.timeout(300)
def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["--n", "256", "512", "--d", "16", "--heads", "2", "--np", "1", "2"]
    argv += ["--repeat", "1", "--out", str(out), "--no-plot", "--no-torch"]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert {"meta", "workers", "runs", "torch"} <= set(doc)
    assert sorted(w["p"] for w in doc["workers"]) == [1, 2]
    for w in doc["workers"]:
        assert 0.1 < w["matmul_gflops_per_rank"] < 1e5
    runs = doc["runs"]
    assert len(runs) == 2 * 2 * 2 * 1 * 2  # pass x P x N x D x causal
    assert sorted({r["pass_"] for r in runs}) == ["bwd", "fwd"]
    assert all(w["isa"] for w in doc["workers"])
    fields = {
        "p",
        "n",
        "d",
        "causal",
        "pass_",
        "time_s",
        "gflops_per_rank",
        "frac_matmul",
        "scaling_eff",
        "peak_mem_mib_per_rank",
        "rss_growth_mib_per_rank",
        "compute_s",
        "wait_s",
        "vs_torch",
    }
    for r in runs:
        assert fields <= set(r), fields - set(r)
        assert r["time_s"] > 0 and math.isfinite(r["time_s"])
        assert 0 < r["gflops_per_rank"] < 1e5
        # the rate agrees with the model flop count and the time
        per = 4 if r["pass_"] == "fwd" else 10
        flops = per * r["n"] ** 2 * 2 * r["d"] / (2 if r["causal"] else 1)
        assert r["gflops_per_rank"] == pytest.approx(flops / r["p"] / r["time_s"] / 1e9)
        assert 0 < r["frac_matmul"] < 10
        assert 0 < r["peak_mem_mib_per_rank"] < 1024
        assert 0 <= r["wait_s"] <= r["time_s"] * 1.5
        if r["p"] == 1:
            assert r["scaling_eff"] == pytest.approx(1.0)
        else:
            assert 0 < r["scaling_eff"] < 10
    table = capsys.readouterr().out
    assert "GF/s/rank" in table and str(out) in table and "CPU kernel:" in table


@pytest.mark.timeout(300)
def test_bench_modifiers_side_by_side(tmp_path, capsys):
    """--mods: softcap / ALiBi rows beside the plain ones, same run, with their ratio."""
    out = tmp_path / "m.json"
    argv = ["--n", "384", "--d", "16", "--heads", "2", "--np", "1", "--causal", "yes"]
    argv += ["--mods", "plain", "softcap", "alibi", "both", "--softcap", "5"]
    argv += ["--repeat", "1", "--out", str(out), "--no-plot", "--no-torch"]
    assert bench.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["pass_"], r["mod"]) for r in runs) == sorted(
        (p, m) for p in ("fwd", "bwd") for m in ("plain", "softcap", "alibi", "both")
    )
    for r in runs:
        assert 0 < r["gflops_per_rank"] < 1e5
        plain = next(x for x in runs if x["pass_"] == r["pass_"] and x["mod"] == "plain")
        assert r["vs_plain"] == pytest.approx(r["gflops_per_rank"] / plain["gflops_per_rank"])
    assert "xplain" in capsys.readouterr().out
