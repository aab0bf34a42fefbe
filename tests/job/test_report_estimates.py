"""The estimates users plan with (issue 26, item 6): memory per rank within 25% of the
peak the run then measures, and the ETA lines (their accuracy is a timing:
benchmarks/eta_accuracy.py)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.job import report as progress_mod
from ringmpi.job.run import run

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _gib(line: str) -> float:
    return float(re.search(r"~([0-9.]+) GiB per rank", line).group(1))


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec beside this Python")
@pytest.mark.parametrize("kind", ["qkv", "features"])
def test_memory_estimate_within_25_percent_of_the_peak(tmp_path, kind):
    """The start line's memory per rank against the peak resident memory, at P = 2."""
    if kind == "qkv":  # big arrays, few flops: the arrays dominate the interpreter
        paths = make_data(
            str(tmp_path / "in.h5"), seq_len=8192, heads=32, kv_heads=32, head_dim=128
        )
        extra = []
    else:
        paths = make_data(
            str(tmp_path / "in.h5"),
            seq_len=16384,
            heads=8,
            kv_heads=8,
            head_dim=64,
            features=768,
            bias=True,
        )
        extra = ["--weights", paths.pop()]
    summary = tmp_path / "s.json"
    out = str(tmp_path / "o.h5")
    cmd = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "ringmpi",
        "run",
        *paths,
        *extra,
        "-o",
        out,
        "--causal",
        "--summary-json",
        str(summary),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    first = [ln for ln in r.stderr.splitlines() if "GiB per rank" in ln][0]
    est = _gib(first)
    peak = json.loads(summary.read_text())["peak_rss_bytes_max"] / 2**30
    assert abs(est - peak) <= 0.25 * peak, f"estimate {est:.3f} GiB, peak {peak:.3f} GiB: {first}"


def test_first_eta_is_given_early_and_counts_down(tmp_path, monkeypatch):
    """A progress line with an ETA comes before the run ends, and the ETAs fall.

    How close the first ETA is to the time the run then takes is a timing: it is
    benchmarks/eta_accuracy.py (it prints the ratios), not a test."""
    x, w = make_data(
        str(tmp_path / "in.h5"), seq_len=12288, heads=4, kv_heads=4, head_dim=32, features=2048
    )
    monkeypatch.setattr(progress_mod, "LOG_EVERY", 0.0)
    stream = io.StringIO()
    monkeypatch.setattr(progress_mod.sys, "stderr", stream)
    run([x], str(tmp_path / "o.h5"), weights=w, causal=True, device="cpu", output_mode="parts")
    lines = stream.getvalue().splitlines()
    etas = [float(m.group(1)) for ln in lines if (m := re.search(r"ETA ([0-9.]+) s", ln))]
    end = next(i for i, ln in enumerate(lines) if "tokens in" in ln)
    first = next(i for i, ln in enumerate(lines) if "ETA" in ln)
    assert first < end and len(etas) >= 2, stream.getvalue()
    assert all(e >= 0 for e in etas) and etas[-1] < etas[0], etas
