"""Masks beyond causal: time and bytes of sliding windows vs full causal; packed-sequence balance.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py jobs/mask_bench.py --n 32768
    python jobs/mask_bench.py --balance          # work balance of 16 packed sequences (no MPI run)

Windows: ring_attention(causal=True, window=(W, 0)) under the contiguous layout
against full causal attention of the same inputs, same run: time (max over
ranks, best of --repeat), ring steps run and K/V bytes sent in all.
Balance: for 16 sequences of mixed length packed with cu_seqlens, the visible
(query, key) pairs each rank computes under a causal mask, max/mean per layout.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ringmpi
from ringmpi.mask import make_mask


def windows(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    n, h, d = args.n, args.heads, args.head_dim
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    loc = [ringmpi.shard(x, comm, "contiguous") for x in (q, k, v)]
    rows = []
    for w in [None, *args.windows]:
        kw = {} if w is None else {"window": (w, 0)}
        best, st = float("inf"), {}
        for _ in range(args.repeat):
            st = {}
            comm.Barrier()
            t0 = time.perf_counter()
            ringmpi.ring_attention(*loc, comm, causal=True, layout="contiguous", stats=st, **kw)
            best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        rows.append((w, best, st["steps"], comm.allreduce(st["bytes_sent"])))
    if comm.rank == 0:
        t_full, b_full = rows[0][1], rows[0][3]
        print(f"N={n} H={h} D={d} float32 causal, contiguous, P={comm.size}")
        print(
            f"{'window':>8} {'time s':>8} {'x full':>7} {'steps':>6} {'MiB sent':>9} {'x full':>7}"
        )
        for w, t, steps, sent in rows:
            name = "full" if w is None else str(w)
            frac = sent / b_full if b_full else float("nan")
            print(
                f"{name:>8} {t:8.3f} {t / t_full:7.3f} {steps:6d} {sent / 2**20:9.1f} {frac:7.3f}"
            )


def balance(args) -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(50, 4000, 16)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    n = int(cu[-1])
    mask = make_mask(n, n, True, cu_seqlens=cu)
    print(f"16 packed sequences, lengths {lengths.min()}..{lengths.max()}, N={n}, causal")
    print(f"{'P':>3} {'layout':>11} {'max/mean work':>14}")
    for p in args.ranks:
        for layout in ringmpi.LAYOUTS:
            work = []
            for r in range(p):
                lo, hi = mask.bounds(ringmpi.positions(n, r, p, layout, cu_seqlens=cu))
                work.append(int(np.maximum(hi - lo + 1, 0).sum()))
            work = np.array(work, dtype=float)
            print(f"{p:>3} {layout:>11} {work.max() / work.mean():14.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--windows", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--balance", action="store_true", help="only the packed-sequence balance")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    if args.balance:
        balance(args)
    else:
        windows(args)


if __name__ == "__main__":
    main()
