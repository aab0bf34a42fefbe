"""The batch job's first ETA beside the time the run then takes, in the same run.

    OMP_NUM_THREADS=1 python benchmarks/eta_accuracy.py [--runs 3] [--seq-len 12288]

One process runs ``ringmpi.job.run.run`` on a features input whose float64
projection (the read) takes about as long as the attention, with a progress line
at every update; the first line with an ETA is compared with the time from that
line to the end of the run. Prints ETA / time left per run, and the median; a
median outside [0.75, 1.25] is marked and the exit status is 1. A timing on a
shared machine: a busy neighbour during the first percent moves the first ETA by
itself, so read the median of several runs.

Was a test (the first ETA within 25%); a timing is measured and printed here
instead (issue 38). The test keeps what does not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ringmpi.cli.make_data import make_data
from ringmpi.job import report
from ringmpi.job.run import run


def one_run(x: str, w: str, out: str) -> tuple:
    """(first ETA, seconds from that line to the end) of one run."""
    stamps: list = []

    class Stamped(io.StringIO):
        def write(self, text):
            stamps.append((time.perf_counter(), text))
            return len(text)

    saved, report.sys.stderr = report.sys.stderr, Stamped()
    try:
        run([x], out, weights=w, causal=True, device="cpu", output_mode="parts")
    finally:
        report.sys.stderr = saved
    lines = [(t, s) for t, s in stamps if "ETA" in s and "%" in s]
    t_first, text = lines[0]
    t_end = [t for t, s in stamps if "tokens in" in s][0]
    eta = float(re.search(r"ETA ([0-9.]+) s", text).group(1))
    return eta, t_end - t_first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs (default 3)")
    ap.add_argument("--seq-len", type=int, default=12288, help="tokens (default 12288)")
    args = ap.parse_args(argv)
    report.LOG_EVERY = 0.0
    ratios = []
    with tempfile.TemporaryDirectory(prefix="ringmpi-eta-") as tmp:
        x, w = make_data(
            str(Path(tmp) / "in.h5"),
            seq_len=args.seq_len,
            heads=4,
            kv_heads=4,
            head_dim=32,
            features=2048,
        )
        for i in range(args.runs):
            eta, left = one_run(x, w, str(Path(tmp) / f"o{i}.h5"))
            ratios.append(eta / left)
            print(
                f"run {i}: first ETA {eta:.2f} s, then {left:.2f} s left: ETA/left {eta / left:.2f}"
            )
    med = float(np.median(ratios))
    off = not 0.75 <= med <= 1.25
    print(f"median ETA/left {med:.2f}{'  OUTSIDE 0.75-1.25' if off else ''}")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
