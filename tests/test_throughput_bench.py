"""benchmarks/throughput.py: datasets, a tiny run's table against its JSON, outputs, errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "throughput.py")


def _module():
    spec = importlib.util.spec_from_file_location("throughput", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_lognormal_lengths_seeded_and_clipped():
    tp = _module()
    a = tp.lognormal_lengths(5000, 256.0, 3.0, seed=4)
    assert np.array_equal(a, tp.lognormal_lengths(5000, 256.0, 3.0, seed=4))
    assert not np.array_equal(a, tp.lognormal_lengths(5000, 256.0, 3.0, seed=5))
    assert a.min() == 128 and a.max() == 65536  # sigma 3: both clips are hit
    assert abs(np.median(a) - 256) < 40


def test_flop_weighted_median_and_tile_rate():
    tp = _module()
    assert tp.weighted_median([100] * 10 + [1000]) == 1000  # 1e6 of the 1.1e6 S^2 weight
    assert tp.weighted_median([100] * 200 + [1000]) == 100
    best, median = tp.tile_rate(64, seconds=0.05)
    assert 1e8 < median <= best < 1e13  # model flop/s of real calls


def test_table_without_torch_says_n_a():
    tp = _module()
    row = {c: 1.5 for c in tp.COLUMNS}
    row.update({"dataset": "2 x 64", "ring size": "1", "torch s": None, "job/torch": None})
    last = tp.table([row]).splitlines()[-1].split()
    assert last[-2:] == ["n/a", "n/a"] and last[-3] == "1.5"


def test_write_lengths_follows_the_schema(tmp_path):
    from ringmpi.job.input.scan import scan

    tp = _module()
    path = str(tmp_path / "ln.h5")
    tp.write_lengths(path, [130, 7, 300], seed=1)
    plan = scan([path])
    assert [s.length for s in plan.sequences] == [130, 7, 300]
    assert (plan.heads, plan.kv_heads, plan.head_dim, plan.dtype) == (4, 2, 64, "float32")
    import h5py

    with h5py.File(path, "r") as f:
        v = f["seq00002/v"][...]
        k = f["seq00002/k"][...]
    assert abs(v.mean() - 1.0) < 0.02 and 0.05 < v.std() < 0.2  # real-shaped, not N(0, 1)
    assert abs(k.mean() - 0.5) < 0.1
    assert not os.path.exists(path + ".tmp")


def _cell(x: str) -> float:
    return float(x)


def test_tiny_run_table_json_and_verified_outputs(tmp_path):
    out_json = str(tmp_path / "t.json")
    keep = tmp_path / "keep"
    keep.mkdir()
    p = _run(
        "--uniform",
        "3x96",
        "--lognormal",
        "3",
        "--median",
        "150",
        "--ranks",
        "2",
        "--ring-sizes",
        "1",
        "default",
        "--tile-max",
        "256",
        "--keep",
        "--dir",
        str(keep),
        "--json",
        out_json,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out_json) as f:
        data = json.load(f)
    rows, cols = data["rows"], data["columns"]
    assert len(rows) == 4 and [r["ring size"] for r in rows] == ["1", "default (2)"] * 2
    lines = p.stdout.splitlines()
    head = next(i for i, x in enumerate(lines) if x.split()[:1] == ["dataset"])
    printed = [x for x in lines[head + 1 : head + 5]]
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    for r, line in zip(rows, printed):
        cells = line.split()[-8:]  # the numeric columns, "job s" onwards
        job, proc, kb, io, ratio, tiles, tor, jt = cells
        assert r["tokens"] == sum(r["lengths"]) and len(r["lengths"]) == 3
        if r["dataset"] == "3 x 96":
            assert r["lengths"] == [96] * 3
        assert 0 < _cell(job) < _cell(proc), line  # the process includes the launch
        assert _cell(kb) > 0 and _cell(io) > 0
        bound = max(_cell(kb), _cell(io))
        assert _cell(ratio) == pytest.approx(_cell(job) / bound, rel=2e-3), line
        assert r["job/max(bound)"] == pytest.approx(
            r["job s"] / max(r["kernel-bound s"], r["io-bound s"]), rel=1e-12
        )
        # the job's time in its tiles: a share of its ranks' time, at a real rate
        assert 0 < r["in tiles"] < 1 and _cell(tiles) == pytest.approx(r["in tiles"], rel=2e-3)
        assert 1e-3 < r["in job GFLOP/s"] < 1e4
        # the flops and bytes the bounds are made of
        s = np.array(r["lengths"], dtype=np.int64)
        assert r["model GFLOP"] * 1e9 == pytest.approx(float((4 * 64 * 4 * s * (s + 1) // 2).sum()))
        assert r["read MB"] * 1e6 == s.sum() * (4 + 2 * 2) * 64 * 4
        assert r["kernel-bound s"] == pytest.approx(
            r["model GFLOP"] / 2 / r["tile GFLOP/s"], rel=1e-12
        )
        assert r["io-bound s"] == pytest.approx(
            r["read MB"] / r["read MB/s"] + r["write MB"] / r["write MB/s"], rel=1e-12
        )
        if have_torch:
            assert _cell(tor) > 0 and _cell(jt) == pytest.approx(_cell(job) / _cell(tor), rel=2e-3)
        else:
            assert (tor, jt) == ("n/a", "n/a") and r["torch s"] is None
        ver = subprocess.run(
            [sys.executable, "-m", "ringmpi", "verify", r["output"], r["input"], "--quiet"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert ver.returncode == 0, (ver.stdout + ver.stderr)[-2000:]
    assert len(cols) == 10 and cols[2] == "job s" and cols[7] == "in tiles"


def test_bad_arguments_and_a_failing_launcher(tmp_path):
    p = _run("--uniform", "3y96")
    assert p.returncode == 2 and "NxS" in p.stderr.strip().splitlines()[-1]
    p = _run("--ring-sizes", "two")
    assert p.returncode == 2 and "--ring-sizes" in p.stderr.strip().splitlines()[-1]
    p = _run("--json", str(tmp_path / "no" / "t.json"))
    assert p.returncode == 2 and "no folder for --json" in p.stderr.strip().splitlines()[-1]
    p = _run(
        "--uniform",
        "2x64",
        "--lognormal",
        "0",
        "--ring-sizes",
        "1",
        "--no-torch",
        "--mpiexec",
        "/bin/false",
        "--dir",
        str(tmp_path),
    )
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "ringmpi run exited 1" in err[0], p.stderr
    assert os.listdir(tmp_path) == []  # the private folder is gone


def _tiny_run(tmp_path, uniform: str, *extra: str) -> tuple:
    """(process, JSON rows) of one dataset of ``uniform`` sequences at P = 1, ring size 1,
    no torch, a 64-token rate probe, in ``tmp_path``; ``extra``: more options."""
    out_json = str(tmp_path / "r.json")
    args = ["--uniform", uniform, "--lognormal", "0", "--ranks", "1", "--ring-sizes", "1"]
    args += ["--no-torch", "--tile-max", "64", "--dir", str(tmp_path), "--json", out_json]
    p = _run(*args, *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out_json) as f:
        return p, json.load(f)["rows"]


def test_repeat_takes_turns_and_reports_the_median_and_range(tmp_path):
    p, rows = _tiny_run(tmp_path, "2x64", "--variant", "RINGMPI_FSYNC_S=0", "--repeat", "3")
    assert [r["ring size"] for r in rows] == ["1", "1 [RINGMPI_FSYNC_S=0]"]
    for r in rows:
        assert r["runs"] == 3 and 0 < r["job min s"] <= r["job s"] <= r["job max s"]
    lines = p.stdout.splitlines()
    head = [i for i, x in enumerate(lines) if x.split()[:1] == ["dataset"]]
    assert len(head) == 3 and "job min s" in lines[head[2]]  # the range's own table
    ranged = lines[head[2] + 1].split()
    assert ranged[-5:-1] == [
        "3",
        f"{rows[0]['job s']:.4g}",
        f"{rows[0]['job min s']:.4g}",
        f"{rows[0]['job max s']:.4g}",
    ]
    assert os.listdir(tmp_path) == ["r.json"]  # outputs and inputs removed
    p = _run("--repeat", "0")
    assert p.returncode == 2 and "--repeat" in p.stderr.strip().splitlines()[-1]


def test_reproducible_row_runs_the_job_in_that_mode(tmp_path):
    """--reproducible: the job once more with `ringmpi run --reproducible`, its own row
    (issue 40's throughput row); its output says it was made in that mode, the plain one not."""
    import h5py

    p, rows = _tiny_run(tmp_path, "3x96", "--reproducible", "--keep")
    assert [r["ring size"] for r in rows] == ["1", "1 [--reproducible]"]
    assert all(r["job s"] > 0 for r in rows)
    modes = []
    for r in rows:
        with h5py.File(r["output"], "r") as f:
            modes.append(bool(f.attrs.get("reproducible", False)))  # written when set
    assert modes == [False, True]
    assert any("[--reproducible]" in line for line in p.stdout.splitlines())
