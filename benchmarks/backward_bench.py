"""Backward tile speed: numpy tile, fused C tile (each ISA) and torch SDPA, in one process.

Every contender computes the gradients of one attention head group for the same inputs
(B=1, H query heads, Hkv=H, one tile covering the whole sequence, like a single-rank ring);
the repeats interleave the contenders so machine noise hits them alike. Reported: median
process CPU time (on a shared machine the wall time includes other processes' turns; it is
printed too), GFLOP/s from it (10 N^2 D H flops, half for causal) and the ratio to torch's
SDPA backward (autograd through ``torch.nn.functional.scaled_dot_product_attention``,
``torch.set_num_threads(1)``, graph kept: only the backward is timed).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/backward_bench.py --n 4096 8192 --d 64 128

ISA variants are built from ``kernels/cpu_backward.c`` with the flags of
``ringmpi.cpu.build`` plus ``-mno-avx512f`` (avx2) or ``-mno-avx2 -mno-fma -mno-avx512f``
(scalar); a variant the CPU cannot run is left out.

Masks beyond causal (``--masks``): one tile over the whole sequence with per-row key ranges
(``bounds``, :mod:`ringmpi.mask`): a causal sliding window (W, 0) and 16 packed causal
sequences of mixed lengths, numpy tile vs fused tile (and the fused full causal tile for
scale), interleaved, median process CPU time:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/backward_bench.py --masks --n 16384 --heads 4

The ring backward (``--ring``, under MPI): ``ring_attention_backward`` with a causal window
(W, 0) against full causal over the same inputs (contiguous layout), median of --repeat of
the slowest rank's wall time:

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python -m mpi4py benchmarks/backward_bench.py \
        --ring --n 32768 --heads 4 --window 256
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy as np

from ringmpi.cpu import build, fused, fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as backward

ISA_FLAGS = {
    "native": [],
    "avx2": ["-mno-avx512f"],
    "scalar": ["-mno-avx2", "-mno-fma", "-mno-avx512f"],
}
WIDTH = {"native": None, "avx2": 32, "scalar": 0}


def build_variant(isa: str):
    """Build and open the backward kernel with this ISA's extra flags (None: not runnable)."""
    if isa == "avx2" and "avx2" not in cpu_isa.host_isas():
        return None
    saved = list(build.FLAGS)
    build.FLAGS[:] = saved + ISA_FLAGS[isa]
    try:
        lib = fused_backward.open_library(build.build_library("cpu_backward.c"))
    finally:
        build.FLAGS[:] = saved
    width = int(lib.rm_backward_simd_width_bytes())
    if WIDTH[isa] is not None and width != WIDTH[isa]:
        raise RuntimeError(f"{isa} build reports SIMD width {width}, expected {WIDTH[isa]}")
    return lib


def inputs(n: int, d: int, heads: int, causal: bool, seed: int = 0):
    """q, k, v, dout (1, H, N, D) float32 and the forward's lse and delta (1, H, N)."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, heads, n, d)).astype(np.float32) for _ in range(4))
    pos = np.arange(n, dtype=np.int64)
    acc = np.zeros_like(q)
    m = np.full((1, heads, n), -np.inf, dtype=np.float32)
    l = np.zeros((1, heads, n), dtype=np.float32)
    fused.forward_tile(q, k, v, pos, pos, acc, m, l, scale=d**-0.5, causal=causal)
    out, lse = fused.finalize(acc, m, l)
    delta = np.einsum("bhsd,bhsd->bhs", do, out)
    return q, k, v, do, lse, delta, pos


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=list(ISA_FLAGS))
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy tile")
    ap.add_argument("--no-torch", action="store_true", help="skip torch")
    ap.add_argument("--masks", action="store_true", help="window / packed tiles (see above)")
    ap.add_argument("--ring", action="store_true", help="ring backward, window vs causal")
    ap.add_argument("--window", type=int, default=256, help="left window size W (W, 0)")
    args = ap.parse_args(argv)
    if args.masks:
        return masks(args)
    if args.ring:
        return ring(args)

    libs = {}
    for isa in args.isa:
        lib = build_variant(isa)
        if lib is None:
            print(f"# {isa}: this CPU cannot run it, skipped")
        else:
            libs[isa] = lib
    torch = None
    if not args.no_torch:
        import torch

        torch.set_num_threads(1)
    print(
        f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} heads={args.heads} "
        f"repeat={args.repeat} (median)"
    )
    print(
        f"{'N':>6} {'D':>4} {'causal':>6} {'tile':>12} {'cpu_s':>8} {'GFLOP/s':>8} "
        f"{'xtorch':>7} {'wall_s':>8}"
    )
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for n in args.n:
        for d in args.d:
            for causal in causals:
                q, k, v, do, lse, delta, pos = inputs(n, d, args.heads, causal)
                scale = d**-0.5
                data = (q, k, v, do, lse, delta, pos, scale, causal)
                runs = {}
                if not args.no_numpy:
                    runs["numpy"] = functools.partial(_tile, backward.backward_tile, *data)
                for isa, lib in libs.items():
                    tile = functools.partial(fused_backward.backward_tile_with, lib)
                    runs[f"fused-{isa}"] = functools.partial(_tile, tile, *data)
                if torch is not None:
                    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
                    tout = torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal
                    )
                    tdo = torch.from_numpy(do)

                    def _torch(tq=tq, tk=tk, tv=tv, tout=tout, tdo=tdo):
                        torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)

                    runs["torch"] = _torch
                times = {name: [] for name in runs}
                walls = {name: [] for name in runs}
                for _ in range(args.repeat):
                    for name, fn in runs.items():
                        w0, t0 = time.perf_counter(), time.process_time()
                        fn()
                        times[name].append(time.process_time() - t0)
                        walls[name].append(time.perf_counter() - w0)
                flops = 10 * n * n * d * args.heads / (2 if causal else 1)
                t_torch = statistics.median(times["torch"]) if "torch" in times else None
                for name, ts in times.items():
                    t = statistics.median(ts)
                    ratio = f"{t_torch / t:7.2f}" if t_torch else "      -"
                    print(
                        f"{n:>6} {d:>4} {str(causal):>6} {name:>12} {t:8.3f} "
                        f"{flops / t / 1e9:8.1f} {ratio} {statistics.median(walls[name]):8.3f}",
                        flush=True,
                    )
    return 0


def packed_lengths(n: int, count: int = 16, seed: int = 1) -> np.ndarray:
    """``count`` mixed sequence lengths (spread over a factor ~30) summing to ``n``."""
    w = np.random.default_rng(seed).uniform(1.0, 30.0, count)
    lengths = np.maximum(1, np.floor(w / w.sum() * n)).astype(np.int64)
    lengths[np.argmax(lengths)] += n - lengths.sum()
    return lengths


def _masked_inputs(n: int, d: int, heads: int, mask, seed: int = 0):
    """q, k, v, dout (1, H, N, D) float32 and lse, delta from the dense masked forward."""
    from ringmpi.reference import attention

    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, heads, n, d)).astype(np.float32) for _ in range(4))
    kw = {"window": mask.window, "cu_seqlens": mask.cu_q}
    t = [np.moveaxis(x, 1, 2) for x in (q, k, v)]  # (1, N, H, D)
    out, lse = attention(*t, mask.causal, dtype=np.float32, block=1024, **kw)
    out = np.ascontiguousarray(np.moveaxis(out, 1, 2))
    delta = np.einsum("bhsd,bhsd->bhs", do, out)
    return q, k, v, do, np.ascontiguousarray(lse), delta


def masks(args) -> int:
    """Numpy vs fused backward tile with window and packed bounds (one rank, whole sequence)."""
    from ringmpi.mask import make_mask

    lib = build_variant(args.isa[0])
    print(
        f"# OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} heads={args.heads} "
        f"repeat={args.repeat} (median process CPU s), float32, fused ISA {args.isa[0]}"
    )
    print(f"{'N':>6} {'D':>4} {'mask':>24} {'numpy_s':>8} {'fused_s':>8} {'x numpy':>8}")
    for n in args.n:
        lengths = packed_lengths(n)
        cases = {
            f"window ({args.window},0) causal": make_mask(n, n, True, window=(args.window, 0)),
            f"packed 16 ({lengths.min()}..{lengths.max()})": make_mask(
                n, n, True, cu_seqlens=np.concatenate(([0], np.cumsum(lengths)))
            ),
        }
        for d in args.d:
            pos = np.arange(n, dtype=np.int64)
            for name, mask in cases.items():
                q, k, v, do, lse, delta = _masked_inputs(n, d, args.heads, mask)
                bounds = mask.bounds(pos)
                fused_tile = functools.partial(fused_backward.backward_tile_with, lib)
                runs = {
                    "numpy": functools.partial(backward.backward_tile, bounds=bounds),
                    "fused": functools.partial(fused_tile, bounds=bounds),
                    "fused causal": fused_tile,
                }
                times = {name: [] for name in runs}
                for _ in range(args.repeat):
                    for tile, fn in runs.items():
                        t0 = time.process_time()
                        _tile(fn, q, k, v, do, lse, delta, pos, d**-0.5, True)
                        times[tile].append(time.process_time() - t0)
                t = {tile: statistics.median(ts) for tile, ts in times.items()}
                print(
                    f"{n:>6} {d:>4} {name:>24} {t['numpy']:8.3f} {t['fused']:8.3f} "
                    f"{t['numpy'] / t['fused']:8.2f}   (fused full causal {t['fused causal']:.3f})",
                    flush=True,
                )
    return 0


def ring(args) -> int:
    """ring_attention_backward with a causal window vs full causal, same inputs (MPI)."""
    from mpi4py import MPI

    import ringmpi

    comm = MPI.COMM_WORLD
    n, h, d = args.n[0], args.heads, args.d[0]
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(4))
    loc = [ringmpi.shard(x, comm, "contiguous") for x in (q, k, v, do)]
    masks_kw = {"causal": {}, f"window ({args.window},0)": {"window": (args.window, 0)}}
    fwd, rows = {}, {}
    for name, kw in masks_kw.items():  # the forward's out and lse, once per mask
        fwd[name] = ringmpi.ring_attention(
            *loc[:3], comm, causal=True, layout="contiguous", return_lse=True, **kw
        )
        rows[name] = []
    for _ in range(args.repeat):  # interleaved: noise hits both alike
        for name, kw in masks_kw.items():
            comm.Barrier()
            t0 = time.perf_counter()
            ringmpi.ring_attention_backward(
                loc[3], *loc[:3], *fwd[name], comm, causal=True, layout="contiguous", **kw
            )
            rows[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if comm.rank == 0:
        print(
            f"# ring_attention_backward N={n} H={h} D={d} float32 contiguous P={comm.size} "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, median of {args.repeat} "
            "(slowest rank wall s)"
        )
        t_full = statistics.median(rows["causal"])
        for name, ts in rows.items():
            t = statistics.median(ts)
            print(f"{name:>16} {t:8.3f} s  x causal {t / t_full:6.3f}   runs {ts}", flush=True)
    return 0


def _tile(fn, q, k, v, do, lse, delta, pos, scale, causal):
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    fn(q, k, v, do, lse, delta, pos, pos, dq, dk, dv, scale=scale, causal=causal)


if __name__ == "__main__":
    sys.exit(main())
