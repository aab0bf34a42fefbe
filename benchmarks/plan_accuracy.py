"""The planner's predicted ring_attention time beside the time measured in the same run.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/plan_accuracy.py

For each shape, the compute rate ``ringmpi plan`` would use is measured
(:func:`ringmpi.cli.plan.measure_compute`), the link too where there are several ranks,
and ring_attention is timed on the same ranks; the calls alternate three times, so a
burst of load on a shared machine hits both sides alike, and the best of each is kept
(the fastest call against the highest rate). Prints predicted / measured per shape; the
model assumes one core per rank, so run it with no more ranks than cores. A ratio
outside [0.7, 1.3] is marked and the exit status is 1.

Was a test (the prediction within 30%); a timing on a noisy machine is measured and
printed here instead (issue 38).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import ringmpi
from ringmpi.cli import plan

SHAPES = [  # (N, H, D, causal)
    (4096, 4, 64, False),
    (8192, 4, 64, False),
    (4096, 4, 128, False),
    (8192, 4, 64, True),
]


def measure(comm, n, h, d, causal, repeat=3):
    """(compute rate GF/s, measured seconds) of one shape, the best of ``repeat`` each."""
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    n_local = n // comm.size
    rates, times = [], []
    for _ in range(repeat):
        rate = plan.measure_compute(
            d, h=h, hkv=h, n_local=min(n_local, 8192), causal=causal, repeat=1
        )
        rates.append(float(np.median(comm.allgather(rate))))
        comm.Barrier()
        t0 = time.perf_counter()
        ringmpi.ring_attention(*loc, comm, causal=causal)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.max(rates)), float(np.min(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="alternations per shape (default 3)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    link = plan.measure_link(comm)
    gbps, lat = link if link else (plan.DEFAULT_LINK_GBPS, plan.DEFAULT_LATENCY_S)
    bad = 0
    for n, h, d, causal in SHAPES:
        rate, meas = measure(comm, n, h, d, causal, args.repeat)
        pred = plan.predict(
            n, h, h, d, ranks=comm.size, causal=causal, gflops=rate, link_gbps=gbps, latency_s=lat
        )["time_s"]
        ratio = pred / meas
        off = not 0.7 <= ratio <= 1.3
        bad += off
        if comm.rank == 0:
            print(
                f"N={n} H={h} D={d} causal={causal} P={comm.size}: {rate:.1f} GF/s, "
                f"predicted {pred:.3f} s, measured {meas:.3f} s, "
                f"predicted/measured {ratio:.2f}{'  OUTSIDE 0.7-1.3' if off else ''}",
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
