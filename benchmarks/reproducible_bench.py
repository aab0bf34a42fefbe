"""Reproducible mode (issue 40): its time against the default mode's, side by side, same run.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/reproducible_bench.py --n 2048

For each mask (none, causal) and dtype: ring_attention of the same inputs with and
without ``reproducible=True`` (the default CPU tile, ``RINGMPI_CPU_KERNEL``), time
as the max over ranks, median of --repeat; the repeats alternate the two modes, so
both see the same machine load. Prints both times and their ratio, and the max
error of each against nothing but the other (a sanity figure, not an accuracy test).

``--backward``: the same for ``ring_attention_backward`` (each mode's forward run once,
untimed; the max |diff| is over dq, dk, dv):

    OMP_NUM_THREADS=1 python benchmarks/reproducible_bench.py --backward --n 1024
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ringmpi
from ringmpi.testing import random_qkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048, help="tokens (default 2048)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "float64", "both"], default="both")
    ap.add_argument("--backward", action="store_true", help="time the backward instead")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    dtypes = [np.float32, np.float64] if args.dtype == "both" else [np.dtype(args.dtype).type]
    kernels = {}
    for dtype in dtypes:
        rng = np.random.default_rng(0)
        qkv = random_qkv(
            rng, args.n, args.heads, args.kv_heads, args.d, dtype=dtype, realistic=True
        )
        cut = [ringmpi.shard(x, comm) for x in qkv]
        dout = ringmpi.shard(rng.standard_normal(qkv[0].shape).astype(dtype), comm)
        for causal in (False, True):
            times = {False: [], True: []}
            outs = {}
            fwd = {}
            if args.backward:  # each mode's own forward, untimed
                for rep in (False, True):
                    fwd[rep] = ringmpi.ring_attention(
                        *cut, comm, causal=causal, reproducible=rep, return_lse=True
                    )
            for _ in range(args.repeat):
                for rep in (False, True):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    st = {}
                    if args.backward:
                        outs[rep] = ringmpi.ring_attention_backward(
                            dout, *cut, *fwd[rep], comm, causal=causal, reproducible=rep, stats=st
                        )
                    else:
                        outs[rep] = ringmpi.ring_attention(
                            *cut, comm, causal=causal, reproducible=rep, stats=st
                        )
                    kernels[rep] = st.get("reproducible_kernel", st.get("tile"))
                    times[rep].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            pairs = zip(*(outs[x] if args.backward else (outs[x],) for x in (True, False)))
            diff = max(float(np.abs(a - b).max(initial=0.0)) for a, b in pairs)
            diff = comm.allreduce(diff, op=MPI.MAX)
            t_def, t_rep = (float(np.median(times[x])) for x in (False, True))
            rows.append((np.dtype(dtype).name, causal, t_def, t_rep, diff))
    if comm.rank == 0:
        what = "backward" if args.backward else "forward"
        print(f"{what} P={comm.size} N={args.n} H={args.heads} Hkv={args.kv_heads} D={args.d}")
        print(f"default: {kernels[False]}; reproducible: {kernels[True]}")
        print(
            f"{'dtype':8} {'causal':6} {'default s':>10} {'reprod. s':>10} {'ratio':>7}"
            f" {'max |diff|':>10}"
        )
        for name, causal, t_def, t_rep, diff in rows:
            print(
                f"{name:8} {causal!s:6} {t_def:10.3f} {t_rep:10.3f} {t_rep / t_def:7.1f}"
                f" {diff:10.2e}"
            )


if __name__ == "__main__":
    main()
