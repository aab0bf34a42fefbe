"""The estimates users plan with (issue 26, item 6): memory per rank and the first ETA,
each within 25% of what the run then measures."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time

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


def test_first_eta_within_25_percent_of_the_time_left(tmp_path, monkeypatch):
    """Features input whose float64 projection (the read) takes as long as the attention.

    A run of about a second on a shared machine: a busy neighbour during its first percent
    moves the first ETA by itself, so the estimate gets up to three runs and must be within
    25% in one of them (a wrong estimator fails all three)."""
    x, w = make_data(
        str(tmp_path / "in.h5"), seq_len=12288, heads=4, kv_heads=4, head_dim=32, features=2048
    )
    monkeypatch.setattr(progress_mod, "LOG_EVERY", 0.0)
    seen = []
    for attempt in range(3):
        stream = io.StringIO()
        stamps = []

        class Stamped(io.StringIO):
            def write(self, text, stamps=stamps, stream=stream):
                stamps.append((time.perf_counter(), text))
                return stream.write(text)

        monkeypatch.setattr(progress_mod.sys, "stderr", Stamped())
        run(
            [x],
            str(tmp_path / f"o{attempt}.h5"),
            weights=w,
            causal=True,
            device="cpu",
            output_mode="parts",
        )
        lines = [(t, s) for t, s in stamps if "ETA" in s and "%" in s]
        assert lines, stream.getvalue()
        t_first, text = lines[0]
        t_end = [t for t, s in stamps if "tokens in" in s][0]
        m = re.search(r"ETA ([0-9.]+) s", text)
        assert m, text
        eta, left = float(m.group(1)), t_end - t_first
        seen.append(f"first ETA {eta:.2f} s, then {left:.2f} s: {text.strip()}")
        if abs(eta - left) <= 0.25 * left:
            return
    raise AssertionError("the first ETA was off by more than 25% in 3 runs:\n" + "\n".join(seen))
