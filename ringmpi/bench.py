"""``ringmpi bench``: CPU throughput, scaling and memory of ring attention.

The driver sweeps sequence length N, head size D, causal masking and the number
of ranks P. For each P it launches ``mpiexec -n P python -m mpi4py -m
ringmpi.bench --worker`` (one thread per rank) unless it already runs under an
MPI launcher, in which case it measures that world size only. It prints a table
and writes JSON (and a PNG plot when matplotlib is importable) with:

* forward and backward rows (``--passes``): GFLOP/s per rank, counting the model's
  flops 4 N^2 H D / P forward and 10 N^2 H D / P backward (half for causal);
* the ISA path of the CPU kernel in use (avx512, avx2, scalar: ``RINGMPI_CPU_ISA``);
* the fraction of the float32 matrix-product rate measured on every rank in the
  same worker, on the same cores, at the same time;
* strong-scaling efficiency T1 / (P T_P) against the P = 1 run;
* peak memory per rank: the tracemalloc peak of array allocations (inputs, ring
  buffers, state, output) while a run executes, plus the growth of the resident
  set sampled by a thread (a lower bound: freed heap is reused without growth);
  the fused kernel's own work buffers (packed K/V of one head, ~2 S_k D elements)
  are malloc'd in C and seen only by the resident set;
* torch's scaled_dot_product_attention on the same shapes with P threads, when
  torch is importable (a yardstick only, never a dependency);
* the cost of the score modifiers (``--mods plain softcap alibi both``): the same
  cases with softcap (``--softcap``), with ALiBi (the standard geometric slopes for
  H heads, as ``ringmpi run --alibi``) or both, side by side in one run; the flops
  counted are the same, so the GFLOP/s show each modifier's cost directly (the
  ``vs_plain`` column, ``xplain`` in the table).

The meters and the yardstick are :mod:`ringmpi.bench_measure`, the table and the
plot :mod:`ringmpi.bench_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Optional

from .bench_measure import RssPeak, kernel_isa, matmul_rate, model_flops, torch_sdpa
from .bench_report import plot, summarize
from .files import write_json

__all__ = ["main"]

_LAUNCH_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


_MODS = {"plain": (), "softcap": ("softcap",), "alibi": ("alibi",), "both": ("softcap", "alibi")}


def _mod_kw(mod: str, args) -> dict:
    """The ring_attention keywords of one ``--mods`` entry."""
    kw = {}
    if "softcap" in _MODS[mod]:
        kw["softcap"] = args.softcap
    if "alibi" in _MODS[mod]:
        from .job.modifiers import alibi_slopes  # the job's --alibi slopes

        kw["alibi_slopes"] = alibi_slopes(args.heads)
    return kw


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringmpi bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[8192, 16384], help="sequence lengths")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head sizes")
    p.add_argument("--heads", type=int, default=4, help="query heads H (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default H)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"],
                   help="forward and/or backward rows (default both)")  # fmt: skip
    p.add_argument("--mods", nargs="+", choices=list(_MODS), default=["plain"],
                   help="score modifiers measured side by side (default plain)")  # fmt: skip
    p.add_argument("--softcap", type=float, default=30.0, help="softcap of --mods softcap/both")
    p.add_argument("--np", type=int, nargs="+", default=[1, 2], help="rank counts P")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per case (best kept)")
    p.add_argument("--out", default="bench.json", help="JSON output path")
    p.add_argument("--plot", default=None, help="PNG path (default: JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-torch", action="store_true", help="skip the torch SDPA yardstick")
    p.add_argument("--mpiexec", default=None, help="launcher (default: mpiexec beside python)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    return p


def _cases(args) -> list[dict]:
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    passes = [x for x in ("fwd", "bwd") if x in args.passes]
    mods = [m for m in _MODS if m in args.mods]
    return [
        dict(n=n, d=d, causal=c, pass_=ps, mod=m)
        for ps in passes
        for n in sorted(args.n)
        for d in sorted(args.d)
        for c in causal
        for m in mods
    ]


def _worker(args) -> int:
    """Measure every case at this world size; rank 0 writes the JSON."""
    import gc

    import numpy as np
    from mpi4py import MPI

    from . import ring_attention, ring_attention_backward
    from .partition import counts

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dt = np.dtype(args.dtype)
    h = args.heads
    hkv = args.kv_heads or h
    comm.Barrier()
    mm = comm.gather(matmul_rate(), root=0)
    # warm-up: compile/load the kernel, touch MPI paths
    s = int(counts(256 * size, size, args.layout)[rank])
    x = np.ones((s, h, 16), dtype=dt)
    xk = np.ones((s, hkv, 16), dtype=dt)
    ring_attention(x, xk, xk, comm, causal=True, layout=args.layout)
    results = []
    for case in _cases(args):
        n, d, causal, pass_ = case["n"], case["d"], case["causal"], case["pass_"]
        mkw = _mod_kw(case["mod"], args)
        gc.collect()
        best, best_stats, peak, tpeak = 1e30, {}, 0, 0
        for _ in range(args.repeat):
            gc.collect()
            tracemalloc.start()  # numpy reports its buffers to tracemalloc
            with RssPeak() as mon:
                base = mon.rss()
                rng = np.random.default_rng(rank)
                s = int(counts(n, size, args.layout)[rank])
                q = rng.standard_normal((s, h, d), dtype=np.float64).astype(dt)
                k = rng.standard_normal((s, hkv, d), dtype=np.float64).astype(dt)
                v = rng.standard_normal((s, hkv, d), dtype=np.float64).astype(dt)
                st: dict = {}
                kw = dict(causal=causal, layout=args.layout, **mkw)
                if pass_ == "bwd":
                    out, lse = ring_attention(q, k, v, comm, return_lse=True, **kw)
                    dout = rng.standard_normal(out.shape).astype(dt)
                comm.Barrier()
                t0 = time.perf_counter()
                if pass_ == "fwd":
                    out = ring_attention(q, k, v, comm, stats=st, **kw)
                else:
                    ring_attention_backward(dout, q, k, v, out, lse, comm, stats=st, **kw)
                t1 = time.perf_counter() - t0
                del q, k, v, out
            traced = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            t = comm.allreduce(t1, op=MPI.MAX)
            peak = max(peak, mon.peak - base)
            tpeak = max(tpeak, traced)
            if t < best:
                best, best_stats = t, st
        peaks = comm.gather(peak, root=0)
        tpeaks = comm.gather(tpeak, root=0)
        stats_all = comm.gather(best_stats, root=0)
        if rank == 0:
            flops = model_flops(n, h, d, causal, pass_)
            results.append(
                dict(
                    case,
                    p=size,
                    heads=h,
                    kv_heads=hkv,
                    time_s=best,
                    gflops_per_rank=flops / size / best / 1e9,
                    peak_mem_mib_per_rank=max(tpeaks) / 2**20,
                    rss_growth_mib_per_rank=max(peaks) / 2**20,
                    compute_s=max(x.get("compute_s", 0.0) for x in stats_all),
                    wait_s=max(x.get("wait_s", 0.0) for x in stats_all),
                    backend=stats_all[0].get("backend"),
                )
            )
    if rank == 0:
        doc = dict(
            p=size, matmul_gflops_per_rank=float(np.median(mm)), runs=results, isa=kernel_isa()
        )
        text = json.dumps(doc, indent=1)
        if args.worker_json:
            Path(args.worker_json).write_text(text)
        else:
            print(text)
    return 0


def _mpiexec(args) -> str:
    if args.mpiexec:
        return args.mpiexec
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def _launch(args, p: int, argv: list[str]) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"  # one rank per core
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.json")
        cmd = [_mpiexec(args), "-n", str(p), sys.executable, "-m", "mpi4py", "-m"]
        cmd += ["ringmpi.bench", *argv, "--worker", "--worker-json", path]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(Path(path).read_text())


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``ringmpi bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    cases = _cases(args)
    under_mpi = any(os.environ.get(v) for v in _LAUNCH_ENV)
    if under_mpi:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            # already launched: measure this world size only
            args.worker_json = None if MPI.COMM_WORLD.Get_rank() else args.out + ".worker"
            _worker(args)
            if MPI.COMM_WORLD.Get_rank():
                return 0
            workers = [json.loads(Path(args.out + ".worker").read_text())]
            os.unlink(args.out + ".worker")
        else:
            under_mpi = False
    if not under_mpi:
        workers = [_launch(args, p, argv) for p in sorted(set(args.np))]
    torch_runs: list[dict] = []
    if not args.no_torch:
        for p in sorted({w["p"] for w in workers}):
            torch_runs += torch_sdpa(cases, args.heads, args.dtype, args.repeat, p)
    doc = dict(
        meta=dict(
            dtype=args.dtype,
            heads=args.heads,
            kv_heads=args.kv_heads or args.heads,
            layout=args.layout,
            repeat=args.repeat,
            python=sys.version.split()[0],
            cpu_count=os.cpu_count(),
            env={k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
        ),
        workers=workers,
        runs=[r for w in workers for r in w["runs"]],
        torch=torch_runs,
    )
    summarize(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)  # complete file or none
    print(f"wrote {out}")
    if not args.no_plot:
        png = plot(doc, args.plot or str(out.with_suffix(".png")))
        print(f"wrote {png}" if png else "matplotlib not importable: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
