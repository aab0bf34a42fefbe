"""Time the fused CPU forward on each ISA path against torch SDPA and numpy sgemm, 1 thread.

Usage::

    .venv/bin/python benchmarks/isa_bench.py [--isa avx512 avx2] [--n 8192 16384] [--d 64 128]
        [--causal both|yes|no] [--heads 2] [--repeat 3] [--peers native|avx2]

For every case and round it times, in one process and one after the other: the fused
forward (``fused.load(isa)``: ``forward_tile`` over the whole sequence, then
``finalize``) for every ISA path, torch's ``scaled_dot_product_attention`` on the same
shapes, and a 2048^3 float32 numpy matrix product. Rates count the model's flops
4 N^2 H D (half for causal). The table shows per path the median over rounds of the
GFLOP/s and of the per-round ratios to torch and to sgemm. Times are the calling
thread's CPU time by default (``--clock thread``: all three run single-threaded in this
thread, and other processes sharing the cores then barely disturb the figures), or
elapsed time (``--clock wall``).

``--peers avx2`` makes torch and OpenBLAS run their AVX2 code too (ATEN_CPU_CAPABILITY,
OPENBLAS_CORETYPE, MKL_ENABLE_INSTRUCTIONS, set before they are imported): on an
AVX-512 host this is a proxy for an AVX2-only machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ringmpi.cpu import isa as cpu_isa

_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", nargs="+", default=None, help="paths (default: all but scalar)")
    p.add_argument("--n", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="rounds (median kept)")
    p.add_argument("--peers", choices=["native", "avx2"], default="native")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument(
        "--clock",
        choices=["thread", "wall"],
        default="thread",
        help="thread: CPU time of this thread (robust on a shared machine; all three run "
        "single-threaded in the calling thread); wall: elapsed time",
    )
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for var in _ONE_THREAD:
        os.environ[var] = "1"
    if args.peers == "avx2":
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import numpy as np

    from ringmpi.cpu import fused
    from ringmpi.softmax import init_state

    torch = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(1)
        except ImportError:
            torch = None
    isas = args.isa or [i for i in cpu_isa.host_isas() if i != "scalar"] or ["scalar"]
    kerns = {i: fused.load(i) for i in isas}
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cases = [(n, d, c) for n in args.n for d in args.d for c in causals]
    h = args.heads

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    b = a.T.copy()
    a @ b

    def sgemm() -> float:
        t = clock()
        a @ b
        return 2.0 * 2048**3 / (clock() - t) / 1e9

    rates: dict = {}  # (case, who) -> list of GFLOP/s per round
    ratios: dict = {}  # (case, isa, "torch"|"sgemm") -> list per round
    for rnd in range(args.repeat):
        for n, d, causal in cases:
            flops = 4.0 * n * n * h * d / (2 if causal else 1)
            rng = np.random.default_rng(n + d)
            q, k, v = (rng.standard_normal((1, h, n, d), dtype=np.float32) for _ in range(3))
            pos = np.arange(n, dtype=np.int64)
            mm = sgemm()
            rates.setdefault(((n, d, causal), "sgemm"), []).append(mm)
            tt = None
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
                f = torch.nn.functional.scaled_dot_product_attention
                f(tq[:, :, :256], tk[:, :, :256], tv[:, :, :256], is_causal=causal)
                t = clock()
                f(tq, tk, tv, is_causal=causal)
                tt = flops / (clock() - t) / 1e9
                rates.setdefault(((n, d, causal), "torch"), []).append(tt)
            for name, kern in kerns.items():
                t = clock()
                st = init_state(q.shape, np.float32)
                kern.forward_tile(q, k, v, pos, pos, *st, scale=d**-0.5, causal=causal)
                kern.finalize(*st)
                r = flops / (clock() - t) / 1e9
                rates.setdefault(((n, d, causal), name), []).append(r)
                ratios.setdefault(((n, d, causal), name, "sgemm"), []).append(r / mm)
                if tt is not None:
                    ratios.setdefault(((n, d, causal), name, "torch"), []).append(r / tt)
            print(f"round {rnd + 1}/{args.repeat} N={n} D={d} causal={causal}", file=sys.stderr)

    med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    print(f"peers: {args.peers}; clock: {args.clock}; H={h}; float32; 1 thread; median of", end="")
    print(f" {args.repeat} rounds")
    print(
        f"{'isa':>7} {'N':>6} {'D':>4} {'causal':>6} {'GFLOP/s':>8} {'torch':>7} "
        f"{'x torch':>7} {'sgemm':>7} {'x sgemm':>7}"
    )
    for name in kerns:
        for c in cases:
            print(
                f"{name:>7} {c[0]:>6} {c[1]:>4} {str(c[2]):>6} {med(rates[(c, name)]):>8.1f} "
                f"{med(rates.get((c, 'torch'), [])):>7.1f} "
                f"{med(ratios.get((c, name, 'torch'), [])):>7.2f} "
                f"{med(rates[(c, 'sgemm')]):>7.1f} {med(ratios[(c, name, 'sgemm')]):>7.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
