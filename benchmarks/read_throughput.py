"""Per-rank HDF5 read throughput of each token layout (what ``ringmpi run`` reads).

    mpiexec -n 4 python -m mpi4py benchmarks/read_throughput.py [--seq-len 131072] [--dir /tmp/rt]

Writes one contiguous and one chunked gzip+shuffle+fletcher32 sample file, then
for each layout times ``ringmpi.job.input.reader.Reader.read`` on every rank, cold (the file
dropped from the page cache with posix_fadvise before the read) and warm.
Striped is timed both ways: one strided hyperslab selection per file, and
contiguous blocks subsampled in memory. Prints MB/s per rank (mean and
minimum over the ranks) counting the bytes each rank keeps.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from ringmpi.cli.make_data import make_data
from ringmpi.job.input.reader import Reader
from ringmpi.job.input.scan import scan


def evict(path: str) -> None:
    """Drop a file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--dir", default="/tmp/ringmpi-read-throughput")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    files = {}
    for comp in ("none", "gzip"):
        path = os.path.join(a.dir, f"rt-{comp}-{a.seq_len}.h5")
        if rank == 0 and not os.path.exists(path):
            os.makedirs(a.dir, exist_ok=True)
            make_data(path, seq_len=a.seq_len, compression=None if comp == "none" else comp)
        files[comp] = path
    comm.Barrier()
    cases = [
        ("contiguous", "hyperslab"),
        ("zigzag", "hyperslab"),
        ("striped", "hyperslab"),
        ("striped", "blocks"),
    ]
    if rank == 0:
        mb = os.path.getsize(files["none"]) / 1e6
        print(f"S={a.seq_len} H=8 Hkv=2 D=64 float32 ({mb:.0f} MB), {size} ranks, MB/s per rank")
        print(f"{'storage':8} {'layout':22} {'cold mean':>10} {'cold min':>9} {'warm mean':>10}")
    for comp, path in files.items():
        plan = scan([path])
        seq = plan.sequences[0]
        for layout, strided in cases:
            rates = {"cold": [], "warm": []}
            for mode in ("cold", "warm"):
                for _ in range(a.repeat):
                    if mode == "cold" and rank == 0:
                        evict(path)
                    rd = Reader(plan, rank, size, layout, strided=strided)
                    comm.Barrier()
                    t0 = time.perf_counter()
                    q, k, v = rd.read(seq, check_finite=False)
                    dt = time.perf_counter() - t0
                    rd.close()
                    rates[mode].append((q.nbytes + k.nbytes + v.nbytes) / dt / 1e6)
            cold = np.array(comm.gather(np.median(rates["cold"]), root=0) or [0])
            warm = np.array(comm.gather(np.median(rates["warm"]), root=0) or [0])
            if rank == 0:
                name = layout if layout != "striped" else f"striped ({strided})"
                print(
                    f"{comp:8} {name:22} {cold.mean():10.0f} {cold.min():9.0f} {warm.mean():10.0f}"
                )


if __name__ == "__main__":
    main()
