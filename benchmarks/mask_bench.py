"""Masks beyond causal: time and bytes of sliding windows vs full causal; packed-sequence balance.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/mask_bench.py --n 32768
    OMP_NUM_THREADS=1 python benchmarks/mask_bench.py --tile  # fused vs numpy masked tile, one rank
    python benchmarks/mask_bench.py --balance  # work balance, 16 packed sequences, no MPI

Windows: ring_attention(causal=True, window=(W, 0)) under the contiguous layout
against full causal attention of the same inputs, same run, with each CPU tile of
--kernels (RINGMPI_CPU_KERNEL): time (max over ranks, median of --repeat; the
repeats go round all configurations in turn, so each sees the same machine
load), ring steps run and K/V bytes sent in all.
Tile: one forward tile call with mask bounds, fused C kernel vs numpy tile, over
all N rows and keys (positions 0..N-1), for a causal window and for causal packed
sequences, with plain causal (no bounds) as the yardstick; median of --repeat,
alternating.
Balance: for 16 sequences of mixed length packed with cu_seqlens, the visible
(query, key) pairs each rank computes under a causal mask, max/mean per layout.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringmpi
from ringmpi.mask import make_mask


def _packed_lengths(rng, n_seq: int = 16) -> np.ndarray:
    return rng.integers(50, 4000, n_seq)


def windows(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    n, h, d = args.n, args.heads, args.head_dim
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    loc = [ringmpi.shard(x, comm, "contiguous") for x in (q, k, v)]
    configs = [(kern, w) for kern in args.kernels for w in [None, *args.windows]]
    times: dict = {c: [] for c in configs}
    info: dict = {}
    for _ in range(args.repeat):
        for kern, w in configs:
            os.environ["RINGMPI_CPU_KERNEL"] = kern
            kw = {} if w is None else {"window": (w, 0)}
            st: dict = {}
            comm.Barrier()
            t0 = time.perf_counter()
            ringmpi.ring_attention(*loc, comm, causal=True, layout="contiguous", stats=st, **kw)
            times[kern, w].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            info[kern, w] = (st["backend"], st["steps"], comm.allreduce(st["bytes_sent"]))
    if comm.rank == 0:
        print(
            f"N={n} H={h} D={d} float32 causal, contiguous, P={comm.size}, median of {args.repeat}"
        )
        print(
            f"{'tile':>6} {'window':>8} {'time s':>8} {'x full':>7} {'steps':>6}"
            f" {'MiB sent':>9} {'x full':>7}"
        )
        for kern, w in configs:
            backend, steps, sent = info[kern, w]
            t = float(np.median(times[kern, w]))
            t_full = float(np.median(times[kern, None]))
            b_full = info[kern, None][2]
            name = "full" if w is None else str(w)
            frac = sent / b_full if b_full else float("nan")
            print(
                f"{backend:>6} {name:>8} {t:8.3f} {t / t_full:7.3f} {steps:6d}"
                f" {sent / 2**20:9.1f} {frac:7.3f}"
            )


def tile(args) -> None:
    from ringmpi.cpu import fused, numpy_tile
    from ringmpi.softmax import init_state

    if not fused.available():
        raise SystemExit(f"fused tile unavailable: {fused.unavailable_reason()}")
    rng = np.random.default_rng(0)
    n, h, d = args.n, args.heads, args.head_dim
    lengths = _packed_lengths(rng)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    cu = cu[cu < n].tolist() + [n]  # sequences cut to N tokens
    pos = np.arange(n, dtype=np.int64)
    cases = [
        ("causal, no bounds (yardstick)", None),
        (f"window ({args.tile_window}, 0) causal", dict(window=(args.tile_window, 0))),
        (f"packed causal, {len(cu) - 1} seqs", dict(cu_seqlens=np.array(cu))),
    ]
    q, k, v = (rng.standard_normal((1, h, n, d)).astype(np.float32) for _ in range(3))
    print(f"one tile, N={n} H={h} D={d} float32, fused {fused.isa()}, median of {args.repeat}")
    print(f"{'mask':>30} {'fused s':>8} {'numpy s':>8} {'numpy/fused':>12}")
    for name, kw in cases:
        bounds = None if kw is None else make_mask(n, n, True, **kw).bounds(pos)
        t = {"fused": [], "numpy": []}
        for _ in range(args.repeat):
            for label, fn in (("fused", fused.forward_tile), ("numpy", numpy_tile.forward_tile)):
                st = init_state(q.shape, np.float32)
                t0 = time.perf_counter()
                fn(q, k, v, pos, pos, *st, scale=d**-0.5, causal=True, bounds=bounds)
                t[label].append(time.perf_counter() - t0)
        tf, tn = float(np.median(t["fused"])), float(np.median(t["numpy"]))
        print(f"{name:>30} {tf:8.3f} {tn:8.3f} {tn / tf:12.2f}")


def balance(args) -> None:
    rng = np.random.default_rng(1)
    lengths = _packed_lengths(rng)
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
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["fused", "numpy"],
        choices=["fused", "numpy"],
        help="CPU tiles to time side by side (RINGMPI_CPU_KERNEL)",
    )
    ap.add_argument("--balance", action="store_true", help="only the packed-sequence balance")
    ap.add_argument("--tile", action="store_true", help="only fused vs numpy masked tile")
    ap.add_argument("--tile-window", type=int, default=256)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    if args.balance:
        balance(args)
    elif args.tile:
        tile(args)
    else:
        windows(args)


if __name__ == "__main__":
    main()
