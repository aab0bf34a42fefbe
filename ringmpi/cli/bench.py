"""``ringmpi bench``: CPU throughput, scaling and memory of ring attention.

The driver sweeps sequence length N, head size D, causal masking and the number
of ranks P. For each P it launches ``mpiexec -n P python -m mpi4py -m
ringmpi.cli.bench --worker`` (one thread per rank) unless it already runs under an
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

The meters and the yardstick, the table and the plot all live in this module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Optional

from ..runtime.files import write_json

__all__ = [
    "main",
    "model_flops",
    "kernel_isa",
    "RssPeak",
    "matmul_rate",
    "torch_sdpa",
    "summarize",
    "plot",
]

_LAUNCH_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


_MODS = {"plain": (), "softcap": ("softcap",), "alibi": ("alibi",), "both": ("softcap", "alibi")}


def _mod_kw(mod: str, args) -> dict:
    """The ring_attention keywords of one ``--mods`` entry."""
    kw = {}
    if "softcap" in _MODS[mod]:
        kw["softcap"] = args.softcap
    if "alibi" in _MODS[mod]:
        from ..job.options import alibi_slopes  # the job's --alibi slopes

        kw["alibi_slopes"] = alibi_slopes(args.heads)
    return kw


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringmpi bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[8192, 16384], help="sequence lengths")
    p.add_argument("--d", type=int, nargs="+", default=[64, 128], help="head sizes")
    p.add_argument("--heads", type=int, default=4, help="query heads H (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default H)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument(
        "--passes",
        nargs="+",
        choices=["fwd", "bwd"],
        default=["fwd", "bwd"],
        help="forward and/or backward rows (default both)",
    )
    p.add_argument(
        "--mods",
        nargs="+",
        choices=list(_MODS),
        default=["plain"],
        help="score modifiers measured side by side (default plain)",
    )
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

    from .. import ring_attention, ring_attention_backward
    from ..layout import counts

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
        cmd += ["ringmpi.cli.bench", *argv, "--worker", "--worker-json", path]
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


# ----------------------------------------------------------------------
# What ``ringmpi bench`` measures with besides its timer: model flops, the kernel, meters.
#
# The model flop count (:mod:`ringmpi.cost`), the CPU kernel and its ISA path, the
# float32 matrix-product rate of this process, a resident-set sampler, and torch's
# scaled_dot_product_attention as a yardstick (:mod:`ringmpi.cli.bench` runs them).
# Everything beyond the standard library is imported on use: ``ringmpi bench --help``
# stays light.


def model_flops(n: int, h: int, d: int, causal: bool, pass_: str = "fwd") -> float:
    """Model flops of one call on a whole sequence: 4 N^2 H D forward, 10 backward (causal: half).

    Parameters
    ----------
    n : int
        Tokens N of the sequence (all ranks together).
    h : int
        Query heads H.
    d : int
        Head size D.
    causal : bool
        Half the pairs are visible.
    pass_ : {"fwd", "bwd"}
    """
    from ..cost import flops

    return flops(n * n / (2 if causal else 1), d, h, backward=pass_ != "fwd")


def kernel_isa() -> str:
    """The CPU kernel and its ISA path, e.g. 'fused avx2' (or 'numpy')."""
    import numpy as np

    from ..backend import select

    name = select(np.empty(0, np.float32)).name
    if name != "fused":
        return name
    from ..cpu import fused

    return f"fused {fused.isa()}"


class RssPeak:
    """Sample this process's resident set in a thread; ``peak`` is the maximum seen.

    Parameters
    ----------
    period : float
        Seconds between samples.
    """

    def __init__(self, period: float = 0.002):
        from ..job.resources import resident_bytes

        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._resident = resident_bytes

    def rss(self) -> int:
        """The resident set now, in bytes (:func:`ringmpi.job.resources.resident_bytes`)."""
        return self._resident()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())


def matmul_rate(n: int = 2048, reps: int = 3) -> float:
    """GFLOP/s of this process's float32 (n, n) x (n, n) product, best of ``reps``."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best / 1e9


def torch_sdpa(cases: list, heads: int, dtype: str, repeat: int, threads: int) -> list[dict]:
    """torch SDPA on the plain ``cases`` with ``threads`` threads ([] without torch).

    Parameters
    ----------
    cases : list of dict
        ``n``, ``d``, ``causal``, ``pass_`` and ``mod`` of each case (only "plain"
        ones run: SDPA has no softcap or ALiBi).
    heads : int
        Query heads H; q, k, v are (1, H, N, D).
    dtype : str
        torch dtype name ("float32", "float64").
    repeat : int
        Timed runs per case (best kept).
    threads : int
        torch intra-op threads (restored afterwards).
    """
    try:
        import torch
    except ImportError:
        return []
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    out = []
    try:
        for c in cases:
            if c["mod"] != "plain":
                continue  # SDPA has no softcap / ALiBi: a yardstick for plain rows only
            h = heads
            bwd = c["pass_"] == "bwd"
            q, k, v = (
                torch.randn(1, h, c["n"], c["d"], dtype=dt, requires_grad=bwd) for _ in range(3)
            )
            f = torch.nn.functional.scaled_dot_product_attention
            best = 1e30
            for _ in range(repeat):
                if bwd:  # autograd through SDPA: time the backward call only
                    y = f(q, k, v, is_causal=c["causal"])
                    g = torch.randn_like(y)
                    t = time.perf_counter()
                    y.backward(g)
                else:
                    t = time.perf_counter()
                    f(q, k, v, is_causal=c["causal"])
                best = min(best, time.perf_counter() - t)
                q.grad = k.grad = v.grad = None
            rate = model_flops(c["n"], h, c["d"], c["causal"], c["pass_"]) / best / 1e9
            out.append(dict(c, threads=threads, time_s=best, gflops_per_thread=rate / threads))
    finally:
        torch.set_num_threads(old)
    return out


# ----------------------------------------------------------------------
# The report of ``ringmpi bench``: derived columns, the printed table and the PNG plot.
#
# :func:`ringmpi.cli.bench.main` gathers the workers' runs into one document and hands it here.


def summarize(doc: dict) -> None:
    """Add fractions of matmul, scaling efficiency and torch ratios; print the table.

    Parameters
    ----------
    doc : dict
        ``workers`` (one per world size: ``p``, ``matmul_gflops_per_rank``, ``isa``),
        ``runs`` (one dict per case and world size; gets ``frac_matmul``,
        ``scaling_eff``, ``torch_gflops_per_thread``, ``vs_torch``, ``vs_plain``)
        and ``torch`` (the SDPA rows).
    """
    mm = {w["p"]: w["matmul_gflops_per_rank"] for w in doc["workers"]}
    key = lambda r: (r["n"], r["d"], r["causal"], r["pass_"], r.get("mod", "plain"))  # noqa: E731
    t1 = {key(r): r["time_s"] for r in doc["runs"] if r["p"] == 1}
    plain = {
        key(r)[:4] + (r["p"],): r["gflops_per_rank"]
        for r in doc["runs"]
        if r.get("mod", "plain") == "plain"
    }
    torch = {(key(t), t["threads"]): t["gflops_per_thread"] for t in doc["torch"]}
    for r in doc["runs"]:
        r["frac_matmul"] = r["gflops_per_rank"] / mm[r["p"]]
        r["scaling_eff"] = t1[key(r)] / (r["p"] * r["time_s"]) if key(r) in t1 else None
        tv = torch.get((key(r), r["p"]))
        r["torch_gflops_per_thread"] = tv
        r["vs_torch"] = r["gflops_per_rank"] / tv if tv else None
        pv = plain.get(key(r)[:4] + (r["p"],))
        r["vs_plain"] = r["gflops_per_rank"] / pv if pv else None
    hdr = (
        f"{'pass':>4} {'P':>2} {'N':>6} {'D':>4} {'causal':>6} {'mod':>7} {'time s':>8} "
        f"{'GF/s/rank':>9} {'xplain':>6} "
        f"{'xmatmul':>7} {'eff':>5} {'torch':>7} {'xtorch':>6} {'wait s':>7} {'MiB/rank':>8}"
    )
    isa = doc["workers"][0].get("isa") if doc["workers"] else None
    print(f"float32 matmul GFLOP/s per rank: {mm}   CPU kernel: {isa}")
    print(hdr)
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in doc["runs"]:
        print(
            f"{r['pass_']:>4} {r['p']:>2} {r['n']:>6} {r['d']:>4} {str(r['causal']):>6} "
            f"{r.get('mod', 'plain'):>7} {r['time_s']:>8.3f} "
            f"{r['gflops_per_rank']:>9.1f} {fmt(r['vs_plain'], '>6.2f')} {r['frac_matmul']:>7.2f} "
            f"{fmt(r['scaling_eff'], '>5.2f')} {fmt(r['torch_gflops_per_thread'], '>7.1f')} "
            f"{fmt(r['vs_torch'], '>6.2f')} {r['wait_s']:>7.3f} {r['peak_mem_mib_per_rank']:>8.1f}"
        )


def plot(doc: dict, path: str) -> Optional[str]:
    """Bars of the plain forward GFLOP/s per rank (and torch SDPA, 1 thread) into PNG ``path``.

    Returns ``path``, or None when matplotlib is not importable.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [
        r
        for r in doc["runs"]
        if r.get("pass_", "fwd") == "fwd" and r.get("mod", "plain") == "plain"
    ]  # the plain forward rows
    trs = [t for t in doc["torch"] if t.get("pass_", "fwd") == "fwd"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = sorted({(r["n"], r["d"], r["causal"]) for r in runs})
    ps = sorted({r["p"] for r in runs})
    width = 0.8 / (len(ps) + 1)
    for i, p in enumerate(ps):
        ys = [
            next(
                (
                    r["gflops_per_rank"]
                    for r in runs
                    if r["p"] == p and (r["n"], r["d"], r["causal"]) == lab
                ),
                0.0,
            )
            for lab in labels
        ]
        ax.bar([j + i * width for j in range(len(labels))], ys, width, label=f"ringmpi P={p}")
    ty = [
        next(
            (
                t["gflops_per_thread"]
                for t in trs
                if t["threads"] == 1 and (t["n"], t["d"], t["causal"]) == lab
            ),
            0.0,
        )
        for lab in labels
    ]
    if any(ty):
        ax.bar([j + len(ps) * width for j in range(len(labels))], ty, width, label="torch SDPA 1t")
    for w in doc["workers"]:
        ax.axhline(w["matmul_gflops_per_rank"], ls="--", lw=0.8, color="gray")
    ax.set_xticks([j + width * len(ps) / 2 for j in range(len(labels))])
    ax.set_xticklabels([f"N={n}\nD={d}{' c' if c else ''}" for n, d, c in labels], fontsize=7)
    ax.set_ylabel("GFLOP/s per rank (dashed: fp32 matmul)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
