"""Reproducible mode (issue 40): its time against the default mode's, side by side, same run.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/reproducible_bench.py --n 2048

For each mask (none, causal) and dtype: ring_attention of the same inputs with and
without ``reproducible=True`` (the default CPU tile, ``RINGMPI_CPU_KERNEL``), time
as the max over ranks, median of --repeat; the repeats alternate the two modes, so
both see the same machine load. Prints both times and their ratio, the max
error of each against nothing but the other (a sanity figure, not an accuracy test),
and the ratio of the time in the tiles alone (``stats["compute_s"]``, medians: without
the deals, paddings and the final sums around the ring loop).

``--softcap C``, ``--alibi`` (the standard slopes) and ``--sinks`` (one logit per head)
give both modes those score modifiers; the reproducible mode without them is then timed
in the same repeats too (column "plain s"), so the modifiers' own cost shows.

``--backward``: the same for ``ring_attention_backward`` (each mode's forward run once,
untimed, with the same modifiers; the max |diff| is over dq, dk, dv, and dsinks with
``--sinks``):

    OMP_NUM_THREADS=1 python benchmarks/reproducible_bench.py --backward --n 1024 --softcap 5
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
    ap.add_argument("--softcap", type=float, default=None, help="softcap C for both modes")
    ap.add_argument("--alibi", action="store_true", help="ALiBi (standard slopes), both modes")
    ap.add_argument("--sinks", action="store_true", help="a sink logit per head, both modes")
    ap.add_argument("--backward", action="store_true", help="time the backward instead")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    mods = {}
    if args.softcap is not None:
        mods["softcap"] = args.softcap
    if args.alibi:
        mods["alibi_slopes"] = [2.0 ** (-8 * (i + 1) / args.heads) for i in range(args.heads)]
    if args.sinks:
        mods["sinks"] = np.linspace(-1.0, 3.0, args.heads)
    modes = [(False, mods), (True, mods)] + ([(True, {})] if mods else [])
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
            times = {i: [] for i in range(len(modes))}
            inner = {i: [] for i in range(len(modes))}  # stats["compute_s"]: the tiles
            outs = {}
            fwd = {}
            if args.backward:  # each mode's own forward, untimed
                for i, (rep, kw) in enumerate(modes):
                    fwd[i] = ringmpi.ring_attention(
                        *cut, comm, causal=causal, reproducible=rep, return_lse=True, **kw
                    )
            for _ in range(args.repeat):
                for i, (rep, kw) in enumerate(modes):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    st = {}
                    if args.backward:
                        outs[i] = ringmpi.ring_attention_backward(
                            dout, *cut, *fwd[i], comm, causal=causal, reproducible=rep, stats=st,
                            **kw,
                        )  # fmt: skip
                    else:
                        outs[i] = (
                            ringmpi.ring_attention(
                                *cut, comm, causal=causal, reproducible=rep, stats=st, **kw
                            ),
                        )
                    kernels[rep] = st.get("reproducible_kernel", st.get("tile"))
                    times[i].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                    inner[i].append(comm.allreduce(st.get("compute_s", 0.0), op=MPI.MAX))
            diff = max(float(np.abs(a - b).max(initial=0.0)) for a, b in zip(outs[1], outs[0]))
            diff = comm.allreduce(diff, op=MPI.MAX)
            med = [float(np.median(times[i])) for i in range(len(modes))]
            tiles = [float(np.median(inner[i])) for i in range(2)]
            rows.append((np.dtype(dtype).name, causal, med, diff, tiles))
    if comm.rank == 0:
        what = "backward" if args.backward else "forward"
        print(f"{what} P={comm.size} N={args.n} H={args.heads} Hkv={args.kv_heads} D={args.d}")
        print(f"default: {kernels[False]}; reproducible: {kernels[True]}")
        if mods:
            print(f"score modifiers (both modes): {', '.join(mods)}")
        plain = f" {'plain s':>10}" if mods else ""
        print(
            f"{'dtype':8} {'causal':6} {'default s':>10} {'reprod. s':>10}{plain} {'ratio':>7}"
            f" {'max |diff|':>10} {'tiles ratio':>11}"
        )
        for name, causal, med, diff, tiles in rows:
            extra = f" {med[2]:10.3f}" if mods else ""
            inner = tiles[1] / tiles[0] if tiles[0] > 0 else float("nan")
            print(
                f"{name:8} {causal!s:6} {med[0]:10.3f} {med[1]:10.3f}{extra}"
                f" {med[1] / med[0]:7.2f} {diff:10.2e} {inner:11.2f}"
            )


if __name__ == "__main__":
    main()
