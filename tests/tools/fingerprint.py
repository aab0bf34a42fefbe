"""Behaviour fingerprint: SHA-256 hashes of ringmpi's numerical outputs, to prove a
refactor changed no bits.

Only public interfaces are used, the ones a restructuring of the modules keeps:
the top-level names of ``import ringmpi`` (``ring_attention``,
``ring_attention_backward``, ``decode_attention``, ``shard``, ``gather``,
``grid``, ``positions``, ``LAYOUTS``, ``AttentionSpec``) and the command line
(``python -m ringmpi make-data`` / ``python -m ringmpi run``), plus the documented
environment variables (``RINGMPI_CPU_KERNEL``, ``RINGMPI_BATCH_TOKENS``) and the
documented output file layout (data/README.md, docs/batch-job.md).

Every input comes from a fixed seed and is shaped like real activations
(nonzero means, small spreads, a few large keys); lengths are not multiples of
the rank count (N = 1000, 777; H = 4, Hkv = 2, D = 32). A hash covers the dtype,
the shape and ``np.ascontiguousarray(arr).tobytes()`` of one array. API results
are gathered to the whole sequence (``ringmpi.gather``) and hashed on every rank;
the ranks must agree (checked). Keys hold the rank count P: nothing assumes that
two rank counts give the same bits.

Two modes:

* worker (the API cases at one P), under MPI::

      mpiexec -n P python -m mpi4py tests/tools/fingerprint.py --out api-P.json

* driver (the worker at P = 1..4 for each CPU tile, then the batch job cases),
  launching ``mpiexec`` from the directory of ``sys.executable`` itself, with one
  BLAS/OpenMP thread per rank, from the repository root holding this file::

      .venv/bin/python tests/tools/fingerprint.py --all --out fingerprints.json

  ``--ranks 1,2`` and ``--kernels auto`` shorten it; ``--work DIR --keep`` keeps the
  generated inputs and outputs.

Compare two fingerprints (exit status 1 when a key differs or is missing)::

    python tests/tools/fingerprint.py --compare before.json after.json

The output is one JSON object, case name -> sha256 hex, keys sorted. Keys:
``api/<kernel>/P<P>/<kind>/...`` (forward ``fwd``, backward ``bwd``, ``decode``,
``grid``, ``positions``) and ``job/P<P>/<case>/<dataset>`` (``@attrs``: the output's
root attributes except paths, host and versions). Keep the whole ``--all`` run
small: it takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
H, HKV, D = 4, 2, 32
N, NQ_CROSS = 1000, 777
CU = (0, 3, 260, 261, 700, 1000)  # packed: lengths 3, 257, 1, 439, 300
CU_Q = (0, 100, 400, 777)  # packed cross-attention: q offsets
CU_K = (0, 300, 650, 1000)  # ... and k/v offsets
SLOPES = (2.0**-1, 2.0**-3, 2.0**-5, 2.0**-7)
SINKS = (1.0, -0.5, 0.0, 2.5)
SEED = 20240607
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RINGMPI_BLAS_THREADS": "1",
}
# root attributes of a job's output that name paths, the host or software versions
SKIP_ATTRS = {"inputs", "weights", "host"}


def digest(*arrays: Any) -> str:
    """SHA-256 over the dtype, shape and C-order bytes of each array, in order."""
    h = hashlib.sha256()
    for arr in arrays:
        a = np.ascontiguousarray(arr)
        h.update(f"{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def realistic(seed: int, n: int, heads: int, dtype: str) -> tuple:
    """(q, k, v) of n tokens: per-(head, dim) means, small spreads, five large keys per head."""
    rng = np.random.default_rng([SEED, seed])
    mq = 0.5 + 0.3 * rng.standard_normal((heads, D))
    mk = 0.5 + 0.3 * rng.standard_normal((HKV, D))
    q = mq + 0.3 * rng.standard_normal((n, heads, D))
    k = mk + 0.1 * rng.standard_normal((n, HKV, D))
    v = 1.0 + 0.1 * rng.standard_normal((n, HKV, D))
    for h in range(HKV):
        k[rng.choice(n, size=min(5, n), replace=False), h] *= 6.0
    return tuple(x.astype(dtype) for x in (q, k, v))


def cross_qkv(seed: int, dtype: str) -> tuple:
    """Cross-attention inputs: q of NQ_CROSS tokens, k and v of N."""
    q = realistic(seed, NQ_CROSS, H, dtype)[0]
    _, k, v = realistic(seed + 1, N, H, dtype)
    return q, k, v


class Recorder:
    """Hashes arrays on every rank, checks that the ranks agree, keeps rank 0's."""

    def __init__(self, comm: Any, prefix: str) -> None:
        self.comm, self.prefix, self.hashes = comm, prefix, {}

    def add(self, key: str, *arrays: Any) -> None:
        """Record ``digest(*arrays)`` under ``prefix/key``; every rank must get the same."""
        d = digest(*arrays)
        every = self.comm.allgather(d)
        if len(set(every)) != 1:
            raise RuntimeError(f"{self.prefix}/{key}: the ranks' hashes differ: {every}")
        full = f"{self.prefix}/{key}"
        if full in self.hashes:
            raise RuntimeError(f"duplicate key {full}")
        self.hashes[full] = d


def forward_variants(size: int) -> dict:
    """Name -> (input set, keyword arguments of ring_attention) of the forward cases."""
    mods = {"softcap": 20.0, "alibi_slopes": SLOPES, "sinks": SINKS}
    v = {
        "full": ("self", {}),
        "causal": ("self", {"causal": True}),
        "causal-window64": ("self", {"causal": True, "window": (64, 0)}),
        "window32-16": ("self", {"window": (32, 16)}),
        "window-left-unbounded": ("self", {"window": (-1, 8)}),
        "scale0.1-window": ("self", {"scale": 0.1, "window": (100, 100)}),
        "packed-full": ("self", {"cu_seqlens": CU}),
        "packed-causal": ("self", {"causal": True, "cu_seqlens": CU}),
        "packed-causal-window48": ("self", {"causal": True, "window": (48, 0), "cu_seqlens": CU}),
        "cross-full": ("cross", {}),
        "cross-causal": ("cross", {"causal": True}),
        "cross-window": ("cross", {"window": (100, 20)}),
        "cross-packed-causal": (
            "cross",
            {"causal": True, "cu_seqlens": CU_Q, "cu_seqlens_k": CU_K},
        ),
        "softcap-causal": ("self", {"causal": True, "softcap": 20.0}),
        "alibi-causal": ("self", {"causal": True, "alibi_slopes": SLOPES}),
        "alibi-full": ("self", {"alibi_slopes": SLOPES}),
        "sinks-causal": ("self", {"causal": True, "sinks": SINKS}),
        "mods-packed-causal-window": (
            "self",
            {"causal": True, "window": (48, 0), "cu_seqlens": CU, **mods},
        ),
        "mods-cross-causal": ("cross", {"causal": True, **mods}),
        "batched-causal": ("batched", {"causal": True}),
        "mha-causal": ("mha", {"causal": True}),
    }
    if size % 2 == 0:
        v["hp2-causal"] = ("self", {"causal": True, "head_parallel": 2})
        v["hp2-mods-packed"] = (
            "self",
            {"causal": True, "cu_seqlens": CU, "head_parallel": 2, **mods},
        )
        v["hp2-cross-window"] = ("cross", {"window": (100, 20), "head_parallel": 2})
    if size == 4:
        v["hp4-causal"] = ("self", {"causal": True, "head_parallel": 4})
    return v


BACKWARD = {
    # name -> (layout, input set, keyword arguments)
    "causal": ("zigzag", "self", {"causal": True}),
    "window32-16": ("contiguous", "self", {"window": (32, 16)}),
    "packed-causal": ("striped", "self", {"causal": True, "cu_seqlens": CU}),
    "mods-causal": (
        "zigzag",
        "self",
        {"causal": True, "softcap": 20.0, "alibi_slopes": SLOPES, "sinks": SINKS},
    ),
    "cross-causal": ("zigzag", "cross", {"causal": True}),
    "mha-causal-window64": ("striped", "mha", {"causal": True, "window": (64, 0)}),
    "packed-window40-40": ("contiguous", "self", {"window": (40, 40), "cu_seqlens": CU}),
}


def inputs(kind: str, dtype: str) -> tuple:
    """The global (q, k, v) of an input set."""
    if kind == "self":
        return realistic(1, N, H, dtype)
    if kind == "cross":
        return cross_qkv(2, dtype)
    if kind == "mha":
        q, k, v = realistic(3, N, H, dtype)
        k2, v2 = realistic(4, N, H, dtype)[1:]
        return q, np.concatenate([k, k2], axis=1), np.concatenate([v, v2], axis=1)
    if kind == "batched":
        qkv = [realistic(5 + b, 300, H, dtype) for b in range(2)]
        return tuple(np.stack([x[i] for x in qkv]) for i in range(3))
    raise ValueError(kind)


def sharded_call(rm: Any, comm: Any, layout: str, kind: str, dtype: str, kw: dict) -> tuple:
    """(global q, k, v, this rank's q, k, v, gather function for q-side and lse arrays)."""
    q, k, v = inputs(kind, dtype)
    hp = kw.get("head_parallel", 1)
    cu_q = kw.get("cu_seqlens")
    cu_k = kw.get("cu_seqlens_k", cu_q)
    ql = rm.shard(q, comm, layout=layout, head_parallel=hp, cu_seqlens=cu_q)
    kl, vl = (rm.shard(x, comm, layout=layout, head_parallel=hp, cu_seqlens=cu_k) for x in (k, v))

    def gather_q(x: Any, axis: int = -3) -> Any:
        return rm.gather(
            x, q.shape[-3], comm, layout=layout, axis=axis, head_parallel=hp, cu_seqlens=cu_q
        )

    def gather_k(x: Any) -> Any:
        return rm.gather(x, k.shape[-3], comm, layout=layout, head_parallel=hp, cu_seqlens=cu_k)

    return (q, k, v), (ql, kl, vl), gather_q, gather_k


def api_forward(rm: Any, comm: Any, rec: Recorder) -> None:
    """ring_attention over layouts x variants x dtypes; out and lse gathered."""
    for layout in rm.LAYOUTS:
        for name, (kind, kw) in forward_variants(comm.size).items():
            for dtype in ("float32", "float64"):
                _, (ql, kl, vl), gq, _ = sharded_call(rm, comm, layout, kind, dtype, kw)
                out, lse = rm.ring_attention(ql, kl, vl, comm, layout=layout, return_lse=True, **kw)
                key = f"fwd/{layout}/{name}/{dtype}"
                rec.add(f"{key}/out", gq(out))
                rec.add(f"{key}/lse", gq(lse, axis=-1))
        # float16 in, float32 accumulation; without return_lse; the spec= form
        _, (ql, kl, vl), gq, _ = sharded_call(rm, comm, layout, "self", "float16", {})
        out = rm.ring_attention(ql, kl, vl, comm, layout=layout, causal=True)
        rec.add(f"fwd/{layout}/causal/float16/out", gq(out))
        spec = rm.AttentionSpec(
            causal=True, window=(64, 0), cu_seqlens=CU, layout=layout, softcap=30.0, sinks=SINKS
        )
        kw = {"cu_seqlens": CU}
        _, (ql, kl, vl), gq, _ = sharded_call(rm, comm, layout, "self", "float32", kw)
        out, lse = rm.ring_attention(ql, kl, vl, comm, spec=spec, return_lse=True)
        rec.add(f"fwd/{layout}/spec-packed-causal-window-mods/float32/out", gq(out))
        rec.add(f"fwd/{layout}/spec-packed-causal-window-mods/float32/lse", gq(lse, axis=-1))


def api_backward(rm: Any, comm: Any, rec: Recorder) -> None:
    """ring_attention_backward: dq, dk, dv (and dsinks) gathered."""
    cases = dict(BACKWARD)
    if comm.size % 2 == 0:
        cases["hp2-causal"] = ("zigzag", "self", {"causal": True, "head_parallel": 2})
    for name, (layout, kind, kw) in cases.items():
        for dtype in ("float32", "float64"):
            (q, _, _), (ql, kl, vl), gq, gk = sharded_call(rm, comm, layout, kind, dtype, kw)
            rng = np.random.default_rng([SEED, 99])
            dout = (0.1 * rng.standard_normal(q.shape)).astype(dtype)
            dl = rm.shard(
                dout,
                comm,
                layout=layout,
                head_parallel=kw.get("head_parallel", 1),
                cu_seqlens=kw.get("cu_seqlens"),
            )
            out, lse = rm.ring_attention(ql, kl, vl, comm, layout=layout, return_lse=True, **kw)
            grads = rm.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, layout=layout, **kw)
            key = f"bwd/{layout}/{name}/{dtype}"
            rec.add(f"{key}/dq", gq(grads[0]))
            rec.add(f"{key}/dk", gk(grads[1]))
            rec.add(f"{key}/dv", gk(grads[2]))
            if len(grads) > 3:
                rec.add(f"{key}/dsinks", grads[3])


def api_decode(rm: Any, comm: Any, rec: Recorder) -> None:
    """decode_attention: new queries against a cache split over the ranks."""
    for dtype in ("float32", "float64"):
        _, k, v = realistic(7, N, H, dtype)
        q = realistic(8, 4, H, dtype)[0]
        part = np.array_split(np.arange(N), comm.size)[comm.rank]
        kl, vl = k[part], v[part]
        out = rm.decode_attention(q, kl, vl, comm)
        rec.add(f"decode/plain/{dtype}/out", out)
        out, lse = rm.decode_attention(q, kl, vl, comm, return_lse=True, softcap=20.0, sinks=SINKS)
        rec.add(f"decode/softcap-sinks/{dtype}/out", out)
        rec.add(f"decode/softcap-sinks/{dtype}/lse", lse)
        out, lse = rm.decode_attention(
            q[None].repeat(2, 0),
            kl[None].repeat(2, 0),
            vl[None].repeat(2, 0),
            comm,
            scale=0.05,
            return_lse=True,
        )
        rec.add(f"decode/batched-scale/{dtype}/out", out)
        rec.add(f"decode/batched-scale/{dtype}/lse", lse)
        if comm.size > 1:  # rank 0 holds none of the cache
            cuts = np.linspace(0, N, comm.size).astype(int)
            lo = 0 if comm.rank == 0 else cuts[comm.rank - 1]
            hi = 0 if comm.rank == 0 else cuts[comm.rank]
            out, lse = rm.decode_attention(q, k[lo:hi], v[lo:hi], comm, return_lse=True)
            rec.add(f"decode/rank0-empty/{dtype}/out", out)
            rec.add(f"decode/rank0-empty/{dtype}/lse", lse)


def api_grid(rm: Any, comm: Any, rec: Recorder) -> None:
    """ringmpi.grid: one sequence per ring, every ring's gathered output."""
    sizes = [r for r in (1, 2) if comm.size % r == 0 and comm.size > r]
    for r in sizes:
        ring, across = rm.grid(comm, ring_size=r)
        g = comm.rank // r
        q, k, v = realistic(20 + g, NQ_CROSS, H, "float32")
        sl = [rm.shard(x, ring, layout="zigzag") for x in (q, k, v)]
        out, lse = rm.ring_attention(*sl, ring, causal=True, window=(96, 0), return_lse=True)
        full = (rm.gather(out, NQ_CROSS, ring), rm.gather(lse, NQ_CROSS, ring, axis=-1))
        every = across.allgather(full)
        rec.add(
            f"grid/ring{r}x{comm.size // r}/causal-window96/float32", *(a for p in every for a in p)
        )
        for c in (ring, across):
            c.Free()


def api_positions(rm: Any, comm: Any, rec: Recorder) -> None:
    """ringmpi.positions of every rank, layouts x lengths x packing x head_parallel."""
    hps = [u for u in (1, 2, 4) if comm.size % u == 0]
    for layout in rm.LAYOUTS:
        for n, cu in ((N, None), (NQ_CROSS, None), (3, None), (N, CU)):
            for u in hps:
                every = [
                    rm.positions(n, r, comm.size, layout, head_parallel=u, cu_seqlens=cu)
                    for r in range(comm.size)
                ]
                tag = "packed" if cu else "plain"
                rec.add(f"positions/{layout}/n{n}-{tag}/hp{u}", *every)


def worker(out_path: str) -> None:
    """The API cases at this world's size; rank 0 writes the JSON."""
    from mpi4py import MPI

    import ringmpi as rm

    comm = MPI.COMM_WORLD
    kernel = os.environ.get("RINGMPI_CPU_KERNEL", "auto")
    rec = Recorder(comm, f"api/{kernel}/P{comm.size}")
    for part in (api_positions, api_forward, api_backward, api_decode, api_grid):
        t0 = time.perf_counter()
        part(rm, comm, rec)
        if comm.rank == 0:
            print(f"  {part.__name__}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if comm.rank == 0:
        Path(out_path).write_text(json.dumps(rec.hashes, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------- driver: the batch job


def job_cases(size: int, layouts: tuple) -> list:
    """(name, input key, extra flags, extra environment) of the job runs at P = size."""
    cases = []
    for lay in layouts:
        lf = ["--layout", lay]
        cases += [
            (f"{lay}/causal", "plain", [*lf, "--causal"], {}),
            (f"{lay}/causal-window64", "plain", [*lf, "--causal", "--window", "64"], {}),
            (f"{lay}/window32-16", "plain", [*lf, "--window", "32,16"], {}),
            (
                f"{lay}/causal-softcap-alibi",
                "plain",
                [*lf, "--causal", "--softcap", "20", "--alibi"],
                {},
            ),
            (f"{lay}/float64-causal", "f64", [*lf, "--causal"], {}),
            (f"{lay}/packed-causal-window48", "packed", [*lf, "--causal", "--window", "48"], {}),
            (f"{lay}/cross-packed-causal", "cross", [*lf, "--causal"], {}),
            (f"{lay}/features-rope-sinks-causal", "feats", [*lf, "--causal", "--rope"], {}),
        ]
    cases += [
        ("zigzag/full", "plain", [], {}),
        ("zigzag/causal-unbatched", "plain", ["--causal"], {"RINGMPI_BATCH_TOKENS": "0"}),
        ("zigzag/causal-ring-auto", "plain", ["--causal", "--ring-size", "auto"], {}),
        ("zigzag/scale0.1-causal", "plain", ["--causal", "--scale", "0.1"], {}),
        ("zigzag/alibi-slopes-file", "plain", ["--alibi-slopes", "@slopes"], {}),
        ("zigzag/cross-packed-window", "cross", ["--window", "100,20"], {}),
        ("zigzag/float16-causal", "f16", ["--causal"], {}),
        ("zigzag/batch-axis-causal", "batchaxis", ["--causal"], {}),
        ("zigzag/shards-causal", "shards", ["--causal"], {}),
        (
            "striped/features-rope-theta-scale",
            "feats",
            ["--layout", "striped", "--rope", "--rope-theta", "500", "--rope-scale", "2"],
            {},
        ),
    ]
    if size % 2 == 0 and size > 2:
        cases.append(("zigzag/causal-ring2", "plain", ["--causal", "--ring-size", "2"], {}))
    return cases


def run_cmd(cmd: list, env: dict, timeout: float = 600.0) -> None:
    """Run ``cmd`` from the repository root; raise with its output on failure."""
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")


def make_inputs(work: Path, env: dict) -> dict:
    """Write the job inputs with ``ringmpi make-data``; input key -> (paths, extra flags)."""
    import h5py

    py = [sys.executable, "-m", "ringmpi", "make-data"]
    shape = [
        "--heads",
        str(H),
        "--kv-heads",
        str(HKV),
        "--head-dim",
        str(D),
        "--values",
        "realistic",
    ]
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    specs = {
        "plain": ["--seq-len", "777", "--sequences", "3", "--seed", "11"],
        "f64": ["--seq-len", "500", "--sequences", "2", "--dtype", "float64", "--seed", "12"],
        "f16": ["--seq-len", "500", "--sequences", "2", "--dtype", "float16", "--seed", "13"],
        "packed": ["--packed", "3,257,1,439,313", "--sequences", "2", "--seed", "14"],
        "cross": ["--seq-len", "300", "--kv-tokens", "1000", "--packed", "3", "--seed", "15"],
        "feats": [
            "--features",
            "48",
            "--bias",
            "--packed",
            "3",
            "--seq-len",
            "777",
            "--seed",
            "16",
        ],
        "batchaxis": ["--seq-len", "400", "--sequences", "2", "--batch-axis", "--seed", "17"],
        "shards": ["--seq-len", "901", "--shards", "2", "--seed", "18"],
    }
    out = {}
    for key, flags in specs.items():
        path = data / f"{key}.h5"
        run_cmd([*py, str(path), *shape, *flags], env)
        out[key] = ([str(path)], [])
    out["shards"] = ([str(data / "shards.part*.h5")], [])
    # the weights' sinks (H,) join the features input (docs/masks.md)
    w = data / "feats-weights.h5"
    ws = data / "feats-sinks-weights.h5"
    shutil.copyfile(w, ws)
    with h5py.File(ws, "r+") as f:
        f.create_dataset("sinks", data=np.array(SINKS, dtype=np.float64))
    out["feats"] = ([str(data / "feats.h5")], ["--weights", str(ws)])
    slopes = data / "slopes.txt"
    slopes.write_text(" ".join(repr(s) for s in (0.3, 0.05, 0.01, 0.002)) + "\n")
    out["@slopes"] = str(slopes)
    return out


def hash_output(path: Path, prefix: str) -> dict:
    """prefix/name -> hash of each numeric dataset of an output (sorted), and its root attrs."""
    import h5py

    res, names = {}, []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        for name in sorted(names):
            ds = f[name]
            if ds.dtype.kind in "biuf":
                res[f"{prefix}/{name}"] = digest(ds[()])
        attrs = {}
        for k in sorted(f.attrs):
            if k in SKIP_ATTRS or k.endswith("_version"):
                continue
            a = f.attrs[k]
            attrs[k] = a.tolist() if hasattr(a, "tolist") else a
        blob = json.dumps(attrs, sort_keys=True, default=str).encode()
        res[f"{prefix}/@attrs"] = hashlib.sha256(blob).hexdigest()
    return res


def driver(args: argparse.Namespace) -> int:
    """Run the API worker at each P (per CPU tile) and the job cases; write one JSON."""
    t_start = time.perf_counter()
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        raise SystemExit(f"no mpiexec next to {sys.executable}")
    env = {**os.environ, **THREAD_ENV}
    env.pop("RINGMPI_CPU_KERNEL", None)
    env.pop("RINGMPI_BATCH_TOKENS", None)
    where = subprocess.run(
        [sys.executable, "-c", "import ringmpi; print(ringmpi.__file__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    print(f"fingerprint: ringmpi from {where.stdout.strip()}, mpiexec {mpiexec}", file=sys.stderr)
    ranks = [int(r) for r in args.ranks.split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ringmpi-fp-"))
    work.mkdir(parents=True, exist_ok=True)
    hashes: dict = {}
    try:
        mpi = [str(mpiexec), "-n"]
        for kernel in args.kernels.split(","):
            for p in ranks:
                t0 = time.perf_counter()
                out = work / f"api-{kernel}-P{p}.json"
                cmd = [
                    *mpi,
                    str(p),
                    sys.executable,
                    "-m",
                    "mpi4py",
                    str(Path(__file__).resolve()),
                    "--out",
                    str(out),
                ]
                run_cmd(cmd, {**env, "RINGMPI_CPU_KERNEL": kernel})
                got = json.loads(out.read_text())
                hashes.update(got)
                dt = time.perf_counter() - t0
                print(
                    f"fingerprint: api {kernel} P={p}: {len(got)} keys, {dt:.1f} s", file=sys.stderr
                )
        if not args.no_job:
            data = make_inputs(work, env)
            for p in ranks:
                t0 = time.perf_counter()
                cases = job_cases(p, ("contiguous", "zigzag", "striped"))
                for name, key, flags, extra in cases:
                    paths, more = data[key]
                    flags = [data[f] if f.startswith("@") else f for f in flags]
                    out = work / "out" / f"P{p}" / (name.replace("/", "-") + ".h5")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    cmd = [
                        *mpi,
                        str(p),
                        sys.executable,
                        "-m",
                        "mpi4py",
                        "-m",
                        "ringmpi",
                        "run",
                        *paths,
                        "-o",
                        str(out),
                        "--overwrite",
                        "--quiet",
                        "--output-mode",
                        "parts",
                        "--max-memory",
                        "2G",
                        *more,
                        *flags,
                    ]
                    run_cmd(cmd, {**env, **extra})
                    hashes.update(hash_output(out, f"job/P{p}/{name}"))
                dt = time.perf_counter() - t0
                print(f"fingerprint: job P={p}: {len(cases)} runs, {dt:.1f} s", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    dt = time.perf_counter() - t_start
    print(f"fingerprint: {len(hashes)} hashes -> {args.out} in {dt:.1f} s", file=sys.stderr)
    return 0


def compare(a: str, b: str) -> int:
    """Print the keys whose hashes differ or that only one file has; 1 if any."""
    x, y = (json.loads(Path(p).read_text()) for p in (a, b))
    diff = sorted(k for k in x.keys() & y.keys() if x[k] != y[k])
    only = [(p, sorted(s)) for p, s in ((a, x.keys() - y.keys()), (b, y.keys() - x.keys()))]
    for k in diff:
        print(f"differs: {k}")
    for p, keys in only:
        for k in keys:
            print(f"only in {p}: {k}")
    n_only = sum(len(k) for _, k in only)
    print(f"{len(x.keys() & y.keys()) - len(diff)} equal, {len(diff)} differ, {n_only} unmatched")
    return 1 if diff or n_only else 0


def main(argv: Optional[list] = None) -> int:
    """Command line: worker (default), ``--all`` driver, or ``--compare A B``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--all", action="store_true", help="driver: every P, tile and job case")
    ap.add_argument("--ranks", default="1,2,3,4", help="driver: rank counts (default 1,2,3,4)")
    ap.add_argument(
        "--kernels",
        default="auto,numpy",
        help="driver: RINGMPI_CPU_KERNEL values for the API cases",
    )
    ap.add_argument("--no-job", action="store_true", help="driver: skip the batch job cases")
    ap.add_argument("--work", help="driver: folder for inputs and outputs (default a temporary)")
    ap.add_argument("--keep", action="store_true", help="driver: keep the work folder")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprints")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out is required")
    if args.all:
        return driver(args)
    worker(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
