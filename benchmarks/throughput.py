"""Throughput of the batch job on datasets of many sequences, beside its bounds and torch.

    python benchmarks/throughput.py [--ranks 2] [--full] [--json FILE]

For each dataset (uniform 200 x 256 and 48 x 2048, and N log-normal lengths
clipped to [128, 65536]; H=4, Hkv=2, D=64, float32, causal), written seeded
into a private temporary folder, in one run:

* the job, ``mpiexec -n P python -m mpi4py -m ringmpi run IN -o OUT --causal``,
  at ring sizes 1, auto and the default (one ring of all P ranks): its
  summary's ``wall_s`` ("job s") and the process's wall time ("process s");
* the kernel-bound time: the dataset's model flops (4 D H per visible causal
  pair, :mod:`ringmpi.cost`) / P / the fused tile's rate, measured here on a
  causal tile of the dataset's (flop-weighted median) length (the best of its calls;
  "tile median" beside it: the median call, how much the machine's speed moves);
* "in tiles": the share of the ranks' time the job spent inside the tile kernels
  (the summary's ``kernel_share``), and "in job GFLOP/s" (second table): the rate
  the tiles reached on the job's own batches (model flops / their time);
* the I/O-bound time: bytes read (q, k, v) and written (out, lse) at the file
  system's sequential rates, measured here on a file of comparable size
  (written with fsync, read back after dropping it from the page cache);
* when torch is importable, a plain h5py + torch loop on P threads
  (``scaled_dot_product_attention`` on (1, H, S, D), causal) writing ``out``
  to HDF5 (one fsync at the end): its wall time ("torch s").

The inputs are dropped from the page cache before every timed run. The job's
outputs are removed after each run unless ``--keep`` (then ``ringmpi verify
OUT IN`` can check them).

On a shared or virtual machine one run of a job can be 20% off the next.
``--reproducible`` adds a run of each job with ``ringmpi run --reproducible``
(issue 40: the same bits at any P), labelled ``[--reproducible]``.
``--repeat N`` runs every job (and the torch loop) N times, taking turns: all
ring sizes and variants once, then all of them again, so that a slow spell of
the machine hits each of them alike. "job s" and "torch s" are then medians,
"job min s" and "job max s" the range.
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
from typing import Optional

import numpy as np

from ringmpi.cli.make_data import VALUES, make_data
from ringmpi.cost import flops as model_flops

H, HKV, D, DTYPE = 4, 2, 64, "float32"
CHUNK = 8 << 20  # bytes per write/read call of the I/O probe
REPRODUCIBLE = "--reproducible"  # the variant label of the job run with that option
COLUMNS = (
    "dataset",
    "ring size",
    "job s",
    "process s",
    "kernel-bound s",
    "io-bound s",
    "job/max(bound)",
    "in tiles",
    "torch s",
    "job/torch",
)
#: the range of the repeated runs (--repeat)
REPEAT_COLUMNS = ("dataset", "ring size", "runs", "job s", "job min s", "job max s", "torch s")
#: what the bounds are made of, one line per dataset
BOUND_COLUMNS = (
    "dataset",
    "sequences",
    "tokens",
    "model GFLOP",
    "tile S",
    "tile GFLOP/s",
    "tile median",
    "in job GFLOP/s",
    "read MB",
    "write MB",
    "read MB/s",
    "write MB/s",
)


def lognormal_lengths(n: int, median: float, sigma: float, seed: int) -> np.ndarray:
    """Seeded log-normal sequence lengths clipped to [128, 65536].

    Parameters
    ----------
    n : int
        Number of sequences.
    median, sigma : float
        exp(mu) and the standard deviation of log(length).
    seed : int
        Seed of the draw.
    """
    rng = np.random.default_rng([seed, 23])
    x = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return np.clip(np.rint(x), 128, 65536).astype(np.int64)


def write_lengths(path: str, lengths, seed: int) -> None:
    """Write one group per sequence (``seq00000``, ...) with q (S, H, D), k, v (S, Hkv, D).

    Parameters
    ----------
    path : str
        Output HDF5 file (written under a temporary name, then renamed).
    lengths : (N,) int
        Tokens of each sequence.
    seed : int
        Values depend on (seed, sequence) only; k and v are shaped like real
        activations (``ringmpi.cli.make_data.VALUES["realistic"]``).
    """
    import h5py

    tmp = path + ".tmp"
    shapes = {"q": (H, D), "k": (HKV, D), "v": (HKV, D)}
    with h5py.File(tmp, "w") as f:
        for i, s in enumerate(lengths):
            rng = np.random.default_rng([seed, i])
            g = f.create_group(f"seq{i:05d}")
            for name, w in shapes.items():
                mean, spread = VALUES["realistic"].get(name, (0.0, 1.0))
                x = rng.standard_normal((int(s), *w), dtype=np.float32)
                g.create_dataset(name, data=(mean + spread * x).astype(DTYPE))
    os.replace(tmp, path)


def evict(path: str) -> None:
    """Drop a file's clean pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def io_rates(folder: str, nbytes: int) -> tuple:
    """Sequential (write, read) rates in bytes/s of this file system on ``nbytes`` bytes.

    Parameters
    ----------
    folder : str
        Where the probe file is created (exclusively, then removed).
    nbytes : int
        Probe size; written in 8 MiB calls and fsynced, then read back cold.
    """
    path = os.path.join(folder, "io-probe.bin")
    block = np.random.default_rng(1).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, CHUNK)])
        os.fsync(fd)
        w = time.perf_counter() - t0
    finally:
        os.close(fd)
    try:
        evict(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            t0 = time.perf_counter()
            while os.read(fd, CHUNK):
                pass
            r = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        os.remove(path)
    return nbytes / max(w, 1e-9), nbytes / max(r, 1e-9)


def tile_rate(length: int, seconds: float = 1.0) -> tuple:
    """Model flop/s of one fused causal forward tile call of ``length`` tokens: (best, median).

    The bound uses the best call; the median shows how far the machine's own speed
    moves from call to call (on a virtual machine the median can be 10-15% lower).

    Parameters
    ----------
    length : int
        S: q (1, H, S, D) against k, v (1, Hkv, S, D), positions 0..S-1, causal.
    seconds : float
        Calls are repeated (3 to 50) until they took this long in all.
    """
    from ringmpi.backend import select
    from ringmpi.softmax import init_state

    be = select(np.empty(0, DTYPE))
    dt = be.tile_dtype(np.dtype(DTYPE))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, length, D)).astype(dt)
    k = (0.5 + rng.standard_normal((1, HKV, length, D))).astype(dt)
    v = (1.0 + 0.1 * rng.standard_normal((1, HKV, length, D))).astype(dt)
    pos = np.arange(length, dtype=np.int64)
    work = model_flops(length * (length + 1) // 2, D, H)
    rates: list = []
    best, spent, calls = 0.0, 0.0, 0
    # the first call may compile the kernel or warm the caches; on a shared machine the
    # best of several calls is the kernel's rate, the others include other processes' time
    while calls < 3 or (spent < seconds and calls < 50):
        acc, m, l = init_state(q.shape, be.acc_dtype(dt), np)
        t0 = time.perf_counter()
        be.forward_tile(q, k, v, pos, pos, acc, m, l, scale=D**-0.5, causal=True)
        t = time.perf_counter() - t0
        rates.append(work / max(t, 1e-9))
        best, spent, calls = max(best, rates[-1]), spent + t, calls + 1
    return best, float(np.median(rates))


def run_job(
    mpiexec: str,
    ranks: int,
    inp: str,
    out: str,
    ring,
    timeout: float,
    extra_env: Optional[dict] = None,
    extra_args: tuple = (),
) -> dict:
    """Run ``ringmpi run`` under mpiexec; its summary plus ``process_s`` (the launch's wall time).

    Parameters
    ----------
    mpiexec : str
        The launcher; ``ranks`` processes are started.
    inp, out : str
        Input file (dropped from the page cache first) and output file.
    ring : None, int or "auto"
        ``--ring-size``; None: the default (one ring of all ranks).
    timeout : float
        Seconds before the launch is killed (``subprocess.TimeoutExpired``).
    extra_env : dict, optional
        Environment variables set for this launch only (``--variant``).
    extra_args : tuple of str
        More ``ringmpi run`` options (``--reproducible``).
    """
    summary = out + ".summary.json"
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "ringmpi", "run"]
    cmd += [inp, "-o", out, "--causal", "--summary-json", summary, "--overwrite", "--quiet"]
    if ring is not None:
        cmd += ["--ring-size", str(ring)]
    cmd += list(extra_args)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra_env or {})
    evict(inp)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"ringmpi run exited {p.returncode} on {inp}: {tail[0]}")
    with open(summary) as f:
        s = json.load(f)
    os.remove(summary)
    s["process_s"] = wall
    return s


def torch_loop(inp: str, out: str, threads: int) -> float:
    """Seconds of a plain h5py + torch SDPA loop over the sequences of ``inp`` (causal).

    Parameters
    ----------
    inp : str
        Input file: q (S, H, D), k, v (S, Hkv, D) per group (or at the root).
    out : str
        Written: ``out`` (S, H, D) per group; fsynced once at the end.
    threads : int
        torch.set_num_threads.
    """
    import h5py
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    evict(inp)
    t0 = time.perf_counter()
    with h5py.File(inp, "r") as f, h5py.File(out, "w") as g:
        names = [""] if "q" in f else sorted(n for n in f if "q" in f[n])
        for name in names:
            src = f[name] if name else f
            q, k, v = (torch.from_numpy(src[x][...]).transpose(0, 1)[None] for x in "qkv")
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            dst = g.require_group(name) if name else g
            dst.create_dataset("out", data=o[0].transpose(0, 1).contiguous().numpy())
    fd = os.open(out, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def datasets(a) -> list:
    """(name, lengths) of the benchmark's datasets, from the options."""
    out = []
    for spec in a.uniform:
        n, s = (int(x) for x in spec.lower().split("x"))
        out.append((f"{n} x {s}", np.full(n, s, dtype=np.int64)))
    n = a.lognormal if a.lognormal is not None else (10000 if a.full else 2000)
    if n > 0:
        lengths = lognormal_lengths(n, a.median, a.sigma, a.seed)
        out.append((f"{n} log-normal", lengths))
    return out


def weighted_median(lengths) -> int:
    """The length below which half of the causal flops (~S^2) lie."""
    s = np.sort(np.asarray(lengths, dtype=np.float64))
    w = np.cumsum(s * s)
    return int(s[np.searchsorted(w, w[-1] / 2)])


def fmt(x) -> str:
    """A table cell: n/a, an integer as is, else 4 significant digits."""
    if x is None:
        return "n/a"
    return str(x) if isinstance(x, (int, np.integer)) else f"{x:.4g}"


def measure(a, folder: str, mpiexec: str) -> list:
    """Rows of the table (dicts), one per dataset and ring size."""
    rows = []
    esize = np.dtype(DTYPE).itemsize
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    for di, (name, lengths) in enumerate(datasets(a)):
        inp = os.path.join(folder, f"in{di}.h5")
        uniform = bool((lengths == lengths[0]).all())
        if uniform:
            shape = dict(seq_len=int(lengths[0]), heads=H, kv_heads=HKV, head_dim=D)
            make_data(
                inp, **shape, sequences=len(lengths), dtype=DTYPE, seed=a.seed, values="realistic"
            )
        else:
            write_lengths(inp, lengths, a.seed)
        tokens = int(lengths.sum())
        work = float(sum(model_flops(int(s) * (int(s) + 1) // 2, D, H) for s in lengths))
        tile = min(weighted_median(lengths), a.tile_max)
        rate, median_rate = tile_rate(tile)
        kernel_s = work / a.ranks / rate
        read_b = tokens * (H + 2 * HKV) * D * esize
        write_b = tokens * H * (D * esize + 4)  # out (S, H, D) and lse (H, S) float32
        wr, rr = io_rates(folder, min(read_b + write_b, a.io_probe_mb << 20))
        io_s = read_b / rr + write_b / wr
        plain = [None] + a.variant + ([REPRODUCIBLE] if a.reproducible else [])
        runs = [(ring, v) for ring in a.ring_sizes for v in plain]
        done: dict = {cfg: [] for cfg in runs}
        torch_times = []
        for _ in range(a.repeat):  # taking turns: a slow spell hits every configuration
            if have_torch and not a.no_torch:
                tout = os.path.join(folder, f"torch{di}.h5")
                torch_times.append(torch_loop(inp, tout, a.ranks))
                os.remove(tout)
            for j, (ring, variant) in enumerate(runs):
                out = os.path.join(folder, f"out{di}-{j}.h5")
                flags = ("--reproducible",) if variant == REPRODUCIBLE else ()
                extra = None
                if variant and not flags:
                    extra = dict(kv.split("=", 1) for kv in variant.split(","))
                size = None if ring == "default" else ring
                done[(ring, variant)].append(
                    run_job(mpiexec, a.ranks, inp, out, size, a.timeout, extra, flags)
                )
        torch_s = float(np.median(torch_times)) if torch_times else None
        for j, (ring, variant) in enumerate(runs):
            out = os.path.join(folder, f"out{di}-{j}.h5")
            ss = done[(ring, variant)]
            walls = [float(x["wall_s"]) for x in ss]
            s = ss[int(np.argsort(walls)[(len(walls) - 1) // 2])]  # the median run (lower)
            label = f"{ring} ({s.get('ring_size', '?')})" if ring != "1" else "1"
            label += f" [{variant}]" if variant else ""
            job = float(np.median(walls))
            bound = max(kernel_s, io_s)
            rows.append(
                {
                    "dataset": name,
                    "ring size": label,
                    "job s": job,
                    "process s": s["process_s"],
                    "runs": len(walls),
                    "job min s": min(walls),
                    "job max s": max(walls),
                    "kernel-bound s": kernel_s,
                    "io-bound s": io_s,
                    "job/max(bound)": job / bound,
                    "in tiles": s.get("kernel_share"),
                    "in job GFLOP/s": work / max(s.get("compute_s", 0.0) * a.ranks, 1e-9) / 1e9
                    if s.get("compute_s")
                    else None,
                    "torch s": torch_s,
                    "job/torch": job / torch_s if torch_s else None,
                    "sequences": len(lengths),
                    "tokens": tokens,
                    "model GFLOP": work / 1e9,
                    "tile S": tile,
                    "tile GFLOP/s": rate / 1e9,
                    "tile median": median_rate / 1e9,
                    "read MB": read_b / 1e6,
                    "write MB": write_b / 1e6,
                    "read MB/s": rr / 1e6,
                    "write MB/s": wr / 1e6,
                    "ranks": a.ranks,
                    "ring_size_run": s.get("ring_size"),
                    "input": inp,
                    "output": out,
                    "lengths": [int(x) for x in lengths],
                }
            )
            if not a.keep:
                os.remove(out)
                shutil.rmtree(out + ".parts", ignore_errors=True)
        if not a.keep:
            os.remove(inp)
    return rows


def table(rows: list, columns=COLUMNS, unique: bool = False) -> str:
    """A printed table: one line per row (per dataset with ``unique``), the ``columns``."""
    if unique:  # the first row of each dataset (the plain run, before any --variant)
        first: dict = {}
        for r in rows:
            first.setdefault(r["dataset"], r)
        rows = list(first.values())
    cells = [list(columns)] + [
        [r[c] if isinstance(r[c], str) else fmt(r[c]) for c in columns] for r in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in cells)


def parse(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    ap.add_argument("--ranks", type=int, default=2, help="MPI ranks of the job (default 2)")
    ap.add_argument(
        "--uniform",
        nargs="*",
        default=["200x256", "48x2048"],
        metavar="NxS",
        help="uniform datasets: N sequences of S tokens (default 200x256 48x2048)",
    )
    ap.add_argument(
        "--lognormal",
        type=int,
        default=None,
        metavar="N",
        help="log-normal dataset of N sequences (default 2000, --full 10000; 0: none)",
    )
    ap.add_argument("--full", action="store_true", help="the issue's 10,000 log-normal sequences")
    ap.add_argument("--median", type=float, default=256.0, help="median log-normal length")
    ap.add_argument("--sigma", type=float, default=1.25, help="sigma of log(length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ring-sizes",
        nargs="+",
        default=["1", "auto", "default"],
        help="--ring-size values of the job ('default': none given)",
    )
    ap.add_argument(
        "--tile-max",
        type=int,
        default=4096,
        help="longest tile timed for the kernel rate (default 4096)",
    )
    ap.add_argument(
        "--io-probe-mb", type=int, default=1024, help="largest I/O probe file in MiB (default 1024)"
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="also run the job with these environment variables, beside the plain run "
        "(repeatable; e.g. RINGMPI_FSYNC_S=0,RINGMPI_KEEP_MEMORY=0 for the per-batch fsync "
        "and glibc's own malloc)",
    )
    ap.add_argument(
        "--reproducible",
        action="store_true",
        help="also run the job with --reproducible (bitwise the same at any P), beside the "
        "plain run, taking turns with it",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every job and the torch loop N times, taking turns; report "
        "medians and the range (default 1)",
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the torch loop")
    ap.add_argument("--dir", default=None, help="parent of the private temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep inputs and outputs (path printed)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--mpiexec", default=None, help="launcher (default: the venv's mpiexec)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per job run")
    a = ap.parse_args(argv)
    if a.ranks < 1:
        ap.error(f"--ranks must be >= 1, not {a.ranks}")
    if a.repeat < 1:
        ap.error(f"--repeat must be >= 1, not {a.repeat}")
    for spec in a.uniform:
        parts = spec.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--uniform takes NxS with positive integers, not {spec!r}")
    for v in a.variant:
        if not all("=" in kv and kv.split("=", 1)[0] for kv in v.split(",")):
            ap.error(f"--variant takes NAME=VALUE[,NAME=VALUE], not {v!r}")
    for r in a.ring_sizes:
        if r not in ("auto", "default") and not (r.isdigit() and int(r) > 0):
            ap.error(f"--ring-sizes takes positive integers, 'auto' or 'default', not {r!r}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        print(f"throughput: error: no folder for --json {a.json}", file=sys.stderr)
        return 2
    mpiexec = a.mpiexec or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    mpiexec = mpiexec or shutil.which("mpiexec")
    if not mpiexec:
        print("throughput: error: no mpiexec found (give --mpiexec)", file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix="ringmpi-throughput-", dir=a.dir)  # mode 0700
    try:
        rows = measure(a, folder, mpiexec)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print(f"throughput: error: {e}", file=sys.stderr)
        return 1
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"P={a.ranks} ranks, H={H} Hkv={HKV} D={D} {DTYPE}, causal")
    print(table(rows))
    print(table(rows, BOUND_COLUMNS, unique=True))
    if a.repeat > 1:
        print(table(rows, REPEAT_COLUMNS))
    if a.keep:
        print(f"inputs and outputs kept in {folder}")
    if a.json:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(a.json)), suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"columns": list(COLUMNS), "rows": rows}, f, indent=1)
            os.replace(tmp, a.json)
        except BaseException:
            os.remove(tmp)
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
