"""The plan scan's low-level dataset facts equal h5py's, and benchmarks/metadata_bench.py runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.job.input import files as inputs
from ringmpi.job.input import files as trust

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"chunks": (4, 2, 8)},
        {"chunks": (3, 1, 8), "compression": "gzip", "shuffle": True},
        {"compact": True},
        {"dtype": "f8"},
        {"dtype": "f2", "chunks": True},
    ],
)
def test_lite_dataset_reads_what_h5py_reads(tmp_path, kw):
    p = str(tmp_path / "x.h5")
    kw = dict(kw)
    dtype = kw.pop("dtype", "f4")
    compact = kw.pop("compact", False)
    data = (0.5 + np.random.default_rng(0).standard_normal((10, 2, 8))).astype(dtype)
    with h5py.File(p, "w") as f:
        g = f.create_group("seq")
        if compact:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_layout(h5py.h5d.COMPACT)
            sid = h5py.h5s.create_simple(data.shape)
            tid = h5py.h5t.py_create(data.dtype)
            h5py.h5d.create(g.id, b"q", tid, sid, dcpl=dcpl).write(h5py.h5s.ALL, h5py.h5s.ALL, data)
        else:
            g.create_dataset("q", data=data, **kw)
    with h5py.File(p, "r") as f:
        ds = f["seq/q"]
        gid = h5py.h5g.open(f.id, b"seq")
        lite = inputs.lite_dataset(p, gid, "seq", "q", 3, 1 << 40)
        assert (lite.name, lite.shape, lite.ndim, lite.dtype, lite.chunks, lite.size) == (
            ds.name,
            ds.shape,
            ds.ndim,
            ds.dtype,
            ds.chunks,
            ds.size,
        )
        assert lite.dtype_name == ds.dtype.name
        for check in (trust.check_layout, trust.check_written):
            assert check(lite) == check(ds) == ""


def test_lite_dataset_refuses_like_dataset(tmp_path):
    p = str(tmp_path / "bad.h5")
    with h5py.File(p, "w") as f:
        g = f.create_group("seq")
        g["i"] = np.zeros((4, 2, 8), np.int32)
        g["flat"] = np.zeros(8, np.float32)
        g.create_group("grp")
        g["dangling"] = h5py.SoftLink("/nowhere")
        g.create_dataset("hole", (4, 2, 8), "f4")  # never written
    cases = {
        "i": "has dtype int32",
        "flat": "expected 3 dimensions",
        "grp": "is not a dataset",
        "dangling": "missing dataset",
        "missing": "missing dataset",
        "hole": "bytes written",
    }
    with h5py.File(p, "r") as f:
        gid = h5py.h5g.open(f.id, b"seq")
        for name, words in cases.items():
            with pytest.raises(inputs.InputError, match=words):
                inputs.lite_dataset(p, gid, "seq", name, 3, 1 << 40)
            if name != "missing":  # the high-level check says the same
                with pytest.raises(inputs.InputError, match=words):
                    inputs.dataset(p, f["seq"], name, 3, 1 << 40)


def test_metadata_bench_prints_both_ratios(tmp_path):
    js = tmp_path / "m.json"
    script = str(ROOT / "benchmarks" / "metadata_bench.py")
    r = subprocess.run(
        [sys.executable, script, "--sequences", "30", "--repeat", "1", "--json", str(js)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "plan scan" in r.stdout and "vds index" in r.stdout
    m = json.loads(js.read_text())
    assert m["sequences"] == 30
    for key in ("scan_ratio", "vds_ratio"):
        assert 0 < m[key] < 100, m
