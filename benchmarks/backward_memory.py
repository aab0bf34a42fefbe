"""Per-rank peak memory of one ring_attention_backward call.

Run under MPI, one sequence length per job so each process's ru_maxrss is its own:

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/backward_memory.py --n 8192
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/backward_memory.py --n 16384

numpy reports its array allocations to tracemalloc, so the traced peak during
the call, minus what was allocated before it, is the working memory of the
backward pass (its outputs included). It is compared with the rank's inputs
(N/P tokens) and with one N x N float32 score matrix of a single head.
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc

import numpy as np
from mpi4py import MPI

import ringmpi
from ringmpi.backward import ring_attention_backward

MIB = 2.0**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192, help="global sequence length")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", default="zigzag", choices=ringmpi.LAYOUTS)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    s = len(ringmpi.positions(a.n, rank, size, a.layout))
    rng = np.random.default_rng(rank)
    q, dout = (rng.standard_normal((s, a.heads, a.dim), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((s, a.kv_heads, a.dim), dtype=np.float32) for _ in range(2))
    kw = dict(causal=a.causal, layout=a.layout)
    out, lse = ringmpi.ring_attention(q, k, v, comm, return_lse=True, **kw)
    inputs = sum(x.nbytes for x in (dout, q, k, v, out, lse))

    comm.Barrier()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    stats: dict = {}
    t0 = time.perf_counter()
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, stats=stats, **kw)
    wall = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    outputs = sum(g.nbytes for g in grads)

    nn = a.n * a.n * 4  # one N x N float32 matrix (a single head)
    row = dict(
        rank=rank,
        n=a.n,
        p=size,
        s_local=s,
        inputs_mib=inputs / MIB,
        outputs_mib=outputs / MIB,
        traced_peak_mib=(peak - base) / MIB,
        maxrss_before_mib=rss0,
        maxrss_after_mib=rss1,
        nxn_mib=nn / MIB,
        wall_s=wall,
        wait_s=stats["wait_s"],
        gflops=stats["flops"] / stats["compute_s"] / 1e9 if stats["compute_s"] else 0.0,
    )
    rows = comm.gather(row)
    if rank == 0:
        print(
            f"N={a.n} P={size} H={a.heads} Hkv={a.kv_heads} D={a.dim} float32 "
            f"causal={a.causal} layout={a.layout}"
        )
        print(
            "rank  S_local  inputs  outputs  traced_peak  maxrss(before->after)  "
            "NxN(1 head)  wall_s  wait_s  GFLOP/s"
        )
        for r in rows:
            print(
                f"{r['rank']:4d}  {r['s_local']:7d}  {r['inputs_mib']:6.1f}  "
                f"{r['outputs_mib']:7.1f}  {r['traced_peak_mib']:11.1f}  "
                f"{r['maxrss_before_mib']:8.1f} -> {r['maxrss_after_mib']:8.1f}    "
                f"{r['nxn_mib']:11.1f}  {r['wall_s']:6.2f}  {r['wait_s']:6.3f}  {r['gflops']:7.1f}"
            )
        print("(all sizes MiB; traced_peak = numpy allocations during the call, outputs included)")


if __name__ == "__main__":
    main()
