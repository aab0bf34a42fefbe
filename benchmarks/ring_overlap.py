"""Does the K/V transfer progress while the tile computes? Measure it.

Runs ring_attention twice per kernel, polling MPI between tiles (the default)
and not polling (RINGMPI_POLL=0), and prints per rank the time blocked in
MPI_Waitall after the compute as a share of the call. Without progress, a
rendezvous-sized message only moves inside that Waitall.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/ring_overlap.py --n 16384
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from mpi4py import MPI

import ringmpi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    s = len(ringmpi.positions(a.n, comm.rank, comm.size, "zigzag"))
    q, k, v = (rng.standard_normal((s, a.heads, a.dim), dtype=np.float32) for _ in range(3))
    msg_mib = 2 * s * a.heads * a.dim * 4 / 2**20
    if comm.rank == 0:
        print(f"N={a.n} H={a.heads} D={a.dim} float32 P={comm.size}: {msg_mib:.1f} MiB per message")
        print(
            f"{'kernel':>7} {'poll':>5} {'total s':>8} {'compute s':>9} {'wait s':>9} {'wait %':>7}"
        )
    for kernel in ("fused", "numpy"):
        os.environ["RINGMPI_CPU_KERNEL"] = kernel
        for poll in ("1", "0"):
            os.environ["RINGMPI_POLL"] = poll
            best = None
            for _ in range(a.repeat):
                st: dict = {}
                comm.Barrier()
                ringmpi.ring_attention(q, k, v, comm, stats=st)
                worst = comm.allreduce(st["wait_s"], op=MPI.MAX)
                total = comm.allreduce(st["total_s"], op=MPI.MAX)
                comp = comm.allreduce(st["compute_s"], op=MPI.MAX)
                if best is None or total < best[0]:
                    best = (total, comp, worst)
            if comm.rank == 0:
                t, c, w = best
                print(f"{kernel:>7} {poll:>5} {t:8.3f} {c:9.3f} {w:9.5f} {100 * w / t:6.2f}%")


if __name__ == "__main__":
    main()
