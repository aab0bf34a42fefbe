"""HDF5 input: find the sequences, check them on all ranks together, read each rank's tokens.

The input schema is documented in ``data/README.md``. In short, one or more HDF5
files hold the sequence(s) split along the sequence axis, in the order given:

* ``q`` (S, H, D), ``k`` and ``v`` (S, Hkv, D) at the root: one sequence;
* the same with a leading batch axis, ``q`` (B, S, H, D): B sequences;
* one group per sequence at the root, each holding ``q``, ``k``, ``v`` (S, ...);
* instead of q/k/v, raw features ``x`` (S, F) (or (B, S, F), or per group) plus
  a weights file with ``wq`` (F, H*D), ``wk`` and ``wv`` (F, Hkv*D) and root
  attributes ``num_heads`` and ``num_kv_heads``: q = x @ wq, etc.

Rank 0 scans the metadata of every file (:func:`scan`) and broadcasts a
:class:`Plan`; a problem becomes the same one-line :class:`InputError` on every
rank (:func:`collective`). Each rank then reads only its own tokens with
hyperslab selections (:class:`Reader`): one slice per file for the contiguous
layout, two for zigzag, one strided selection for striped. No rank reads or
allocates a whole sequence; :func:`check_memory` refuses a sequence whose
per-rank footprint exceeds the memory budget before anything is read.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .partition import counts, positions, runs

__all__ = [
    "InputError",
    "SeqInfo",
    "Plan",
    "expand_inputs",
    "scan",
    "make_plan",
    "collective",
    "Reader",
    "rank_bytes",
    "memory_budget",
    "check_memory",
    "parse_size",
    "local_runs",
]

FLOAT_DTYPES = ("float16", "float32", "float64")
# Any declared dimension above this is treated as corrupt rather than merely large.
MAX_DIM = 1 << 40


class InputError(ValueError):
    """A problem with the input or output files, phrased as one line naming the file."""


@dataclass
class SeqInfo:
    """One sequence of the input.

    Attributes
    ----------
    name : str
        Display name ("seq", "b=3" for a batch index, or the group name).
    group : str
        HDF5 group holding the datasets ("" for the root).
    batch : int or None
        Index along the leading batch axis, or None when the datasets are (S, ...).
    lengths : list of int
        Number of tokens of this sequence in each input file, in file order.
    """

    name: str
    group: str
    batch: Optional[int]
    lengths: list

    @property
    def length(self) -> int:
        """Total number of tokens S."""
        return int(sum(self.lengths))

    @property
    def offsets(self) -> np.ndarray:
        """Global index of the first token held by each file, shape (n_files,)."""
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)


@dataclass
class Plan:
    """Everything the ranks need to know about the input, built by :func:`scan`."""

    files: list
    mode: str  # "qkv" or "features"
    structure: str  # "single", "batch" or "groups"
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    sequences: list = field(default_factory=list)
    features: int = 0
    weights: Optional[str] = None

    @property
    def batch_size(self) -> int:
        """Length of the batch axis (0 unless structure == "batch")."""
        return len(self.sequences) if self.structure == "batch" else 0


def _fail(path: str, problem: str):
    raise InputError(f"{path}: {problem}")


def expand_inputs(args: Sequence[str]) -> list:
    """Expand shell-style globs (sorted) in each argument, keeping the argument order."""
    files = []
    for a in args:
        if os.path.exists(a) or not glob.has_magic(a):
            files.append(a)
            continue
        hits = sorted(glob.glob(a))
        if not hits:
            raise InputError(f"{a}: no file matches this pattern")
        files.extend(hits)
    if not files:
        raise InputError("no input file given")
    return files


def _open(path: str):
    import h5py

    if not os.path.exists(path):
        _fail(path, "no such file")
    if os.path.isdir(path):
        _fail(path, "is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        reason = str(e).split("(", 1)[-1].rstrip(")") if "(" in str(e) else str(e)
        _fail(path, f"cannot open as HDF5 (truncated or not an HDF5 file: {reason})")


def _check_storage(path: str, ds, size: int) -> None:
    """Refuse declared shapes that cannot be real and data that lies past the end of file."""
    for n in ds.shape:
        if n > MAX_DIM:
            _fail(path, f"dataset '{ds.name}' declares an absurd shape {ds.shape}")
    try:
        end = 0
        if ds.chunks is None:
            off = ds.id.get_offset()
            if off is not None:
                end = off + ds.id.get_storage_size()
        elif hasattr(ds.id, "chunk_iter") and ds.id.get_num_chunks() <= 1_000_000:
            ends = [0]
            ds.id.chunk_iter(lambda c: ends.append(c.byte_offset + c.size))
            end = max(ends)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        _fail(path, f"dataset '{ds.name}' has unreadable storage metadata ({e})")
    if end > size:
        _fail(path, f"dataset '{ds.name}' extends past the end of the file (truncated?)")


def _dataset(path: str, f, name: str, ndim: int, fsize: int):
    import h5py

    try:
        obj = f.get(name)
    except (KeyError, OSError, RuntimeError) as e:
        _fail(path, f"cannot open dataset '{name}' ({e})")
    if obj is None:
        _fail(path, f"missing dataset '{name}'")
    if not isinstance(obj, h5py.Dataset):
        _fail(path, f"'{name}' is not a dataset")
    if obj.dtype.kind != "f" or obj.dtype.name not in FLOAT_DTYPES:
        _fail(path, f"dataset '{name}' has dtype {obj.dtype}, expected float16, float32 or float64")
    if obj.ndim != ndim:
        _fail(path, f"dataset '{name}' has shape {obj.shape}, expected {ndim} dimensions")
    _check_storage(path, obj, fsize)
    return obj


def _scan_file(path: str, structure_hint: Optional[str]) -> dict:
    """Metadata of one file: {"mode", "structure", "seqs": [(group, batch, shapes)], ...}."""
    f = _open(path)
    try:
        fsize = os.path.getsize(path)
        if "q" in f or "x" in f:
            top = "q" if "q" in f else "x"
            nd = f[top].ndim if hasattr(f[top], "ndim") else 0
            structure = "batch" if nd == (4 if top == "q" else 3) else "single"
            groups = [""]
        else:
            structure = "groups"
            groups = sorted(k for k in f if hasattr(f[k], "keys") and ("q" in f[k] or "x" in f[k]))
            if not groups:
                _fail(path, "no dataset 'q' (or features 'x') at the root or in any group")
        if structure_hint and structure != structure_hint:
            problem = f"{structure} structure, first input is {structure_hint}"
            _fail(path, f"shards do not line up: {problem}")
        mode = "qkv" if "q" in (f[groups[0]] if groups[0] else f) else "features"
        extra = 1 if structure == "batch" else 0
        seqs = []
        for g in groups:
            node = f[g] if g else f
            if mode == "qkv":
                shapes = {n: _dataset(path, node, n, 3 + extra, fsize) for n in ("q", "k", "v")}
            else:
                if "q" in node:
                    _fail(path, f"group '{g}' holds q but others hold features x")
                shapes = {"x": _dataset(path, node, "x", 2 + extra, fsize)}
            info = {n: (d.shape, d.dtype.name) for n, d in shapes.items()}
            seqs.append((g, info))
        return {"mode": mode, "structure": structure, "seqs": seqs}
    finally:
        f.close()


def _check_qkv(path: str, g: str, info: dict, extra: int) -> tuple:
    where = f"group '{g}': " if g else ""
    (qs, qt), (ks, kt), (vs, vt) = info["q"], info["k"], info["v"]
    if not (qt == kt == vt):
        _fail(path, f"{where}q, k, v dtypes differ ({qt}, {kt}, {vt})")
    if ks != vs:
        _fail(path, f"{where}k has shape {ks} but v has shape {vs}")
    if extra and qs[0] != ks[0]:
        _fail(path, f"{where}batch sizes differ: q has {qs[0]}, k has {ks[0]}")
    if qs[extra] != ks[extra]:
        _fail(path, f"{where}length mismatch: q has {qs[extra]} tokens, k and v have {ks[extra]}")
    h, d = qs[-2:]
    hkv, dk = ks[-2:]
    if d != dk:
        _fail(path, f"{where}head dim mismatch: q has D={d}, k and v have D={dk}")
    if h < 1 or hkv < 1 or d < 1:
        _fail(path, f"{where}empty head axis: q {qs}, k {ks}")
    if h % hkv:
        _fail(path, f"{where}H={h} query heads is not a multiple of Hkv={hkv} key/value heads")
    return qs[extra], (h, hkv, d), qt, (qs[0] if extra else None)


def _read_weights(path: str) -> dict:
    f = _open(path)
    try:
        fsize = os.path.getsize(path)
        w = {n: _dataset(path, f, n, 2, fsize) for n in ("wq", "wk", "wv")}
        try:
            h, hkv = int(f.attrs["num_heads"]), int(f.attrs["num_kv_heads"])
        except (KeyError, TypeError, ValueError):
            _fail(path, "needs integer root attributes 'num_heads' and 'num_kv_heads'")
        fq, nq = w["wq"].shape
        fk, nk = w["wk"].shape
        if w["wv"].shape != (fk, nk):
            _fail(path, f"wk has shape {w['wk'].shape} but wv has shape {w['wv'].shape}")
        if fq != fk:
            _fail(path, f"wq has {fq} input features but wk and wv have {fk}")
        if h < 1 or hkv < 1 or nq % h or nk % hkv or nq // max(h, 1) != nk // max(hkv, 1):
            _fail(path, f"wq {w['wq'].shape}, wk {w['wk'].shape} do not fit H={h}, Hkv={hkv}")
        if h % hkv:
            _fail(path, f"num_heads={h} is not a multiple of num_kv_heads={hkv}")
        return {"features": fq, "heads": h, "kv_heads": hkv, "head_dim": nq // h}
    finally:
        f.close()


def _guarded(path: str, fn, *args):
    """Call ``fn``; any unexpected failure on a damaged file becomes an InputError naming it."""
    try:
        return fn(*args)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt metadata raises all kinds of errors
        msg = str(e).splitlines()[0] if str(e) else ""
        _fail(path, f"unreadable HDF5 metadata ({type(e).__name__}: {msg})")


def scan(files: Sequence[str], weights: Optional[str] = None) -> Plan:
    """Read the metadata of every input file and check that they form valid sequences.

    Parameters
    ----------
    files : list of str
        Input files in sequence order (shards along the sequence axis).
    weights : str, optional
        Weights file for raw-feature inputs.

    Returns
    -------
    Plan

    Raises
    ------
    InputError
        One line naming the file and the problem.
    """
    files = [str(p) for p in files]
    metas, structure = [], None
    for p in files:
        metas.append(_guarded(p, _scan_file, p, structure))
        structure = metas[0]["structure"]
    first = metas[0]
    mode = first["mode"]
    extra = 1 if structure == "batch" else 0
    names = [g for g, _ in first["seqs"]]
    w = None
    if mode == "features":
        if weights is None:
            _fail(files[0], "holds raw features 'x'; give the projection weights with --weights")
        w = _guarded(weights, _read_weights, weights)
    elif weights is not None:
        _fail(weights, f"weights given but {files[0]} holds q, k, v (weights need features 'x')")
    per_seq: dict = {g: [] for g in names}
    geom = dtype = batch = None
    for p, meta in zip(files, metas):
        if meta["mode"] != mode:
            _fail(p, f"shards do not line up: {meta['mode']} data, {files[0]} holds {mode}")
        got = [g for g, _ in meta["seqs"]]
        if got != names:
            missing = sorted(set(names) ^ set(got))
            _fail(p, f"shards do not line up: groups differ from {files[0]} ({', '.join(missing)})")
        for g, info in meta["seqs"]:
            if mode == "qkv":
                n, gm, dt, b = _check_qkv(p, g, info, extra)
            else:
                shape, dt = info["x"]
                n, b = shape[extra], (shape[0] if extra else None)
                if shape[-1] != w["features"]:
                    _fail(p, f"x has {shape[-1]} features but {weights} expects {w['features']}")
                gm = (w["heads"], w["kv_heads"], w["head_dim"])
            where = f" (group '{g}')" if g else ""
            if geom is None:
                geom, dtype, batch = gm, dt, b
            if gm != geom:
                _fail(
                    p, f"shards do not line up: (H, Hkv, D) = {gm}{where}, first input has {geom}"
                )
            if dt != dtype:
                _fail(p, f"shards do not line up: dtype {dt}{where}, first input has {dtype}")
            if b != batch:
                _fail(p, f"shards do not line up: batch size {b}, first input has {batch}")
            per_seq[g].append(int(n))
    if structure == "batch":
        seqs = [SeqInfo(f"b={i}", "", i, list(per_seq[""])) for i in range(batch)]
    else:
        seqs = [SeqInfo(g or "seq", g, None, per_seq[g]) for g in names]
    if not seqs:
        _fail(files[0], "batch axis has no sequence")
    for s in seqs:
        if s.length == 0:
            _fail(files[0], f"sequence {s.name} has no token")
    h, hkv, d = geom
    return Plan(
        files=files,
        mode=mode,
        structure=structure,
        heads=h,
        kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
        sequences=seqs,
        features=w["features"] if w else 0,
        weights=weights,
    )


def collective(comm, fn: Callable, *args, **kwargs):
    """Call ``fn`` on every rank; if it fails anywhere, raise the same InputError everywhere.

    The message is the first failing rank's, prefixed with "rank r: " when that
    rank is not the only one (P > 1) and the error is not an InputError (whose
    message already names the file). Only the calling (main) thread uses MPI.
    """
    err = None
    try:
        result = fn(*args, **kwargs)
    except InputError as e:
        err, result = str(e), None
    except Exception as e:  # noqa: BLE001 - any local failure becomes a collective error
        err, result = f"{type(e).__name__}: {e}".splitlines()[0], None
        if comm is not None and comm.Get_size() > 1:
            err = f"rank {comm.Get_rank()}: {err}"
    errs = [err] if comm is None else comm.allgather(err)
    for e in errs:
        if e is not None:
            raise InputError(e)
    return result


def make_plan(comm, inputs: Sequence[str], weights: Optional[str], nranks: int) -> Plan:
    """Rank 0 expands and scans the inputs; every rank gets the Plan or the same InputError."""
    rank = 0 if comm is None else comm.Get_rank()

    def build():
        plan = scan(expand_inputs(inputs), weights)
        for s in plan.sequences:
            if s.length < nranks:
                _fail(
                    plan.files[0],
                    f"sequence {s.name} has {s.length} tokens, fewer than {nranks} ranks",
                )
        return plan

    plan = collective(comm, build) if rank == 0 else collective(comm, lambda: None)
    return plan if comm is None else comm.bcast(plan, root=0)


def parse_size(text: str) -> int:
    """Parse a byte count such as ``"512M"``, ``"16G"`` or ``"1.5T"``."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512M or 16G")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def rank_bytes(plan: Plan, n_local: int, prefetch: bool = True) -> int:
    """Upper estimate of the bytes one rank holding ``n_local`` tokens needs for one sequence.

    Counts the local q/k/v (twice with read-ahead of the next sequence), the
    head-major copies and accumulator state of the ring (acc, m, l in the compute
    dtype), three K/V blocks in flight (current + double-buffered receive), the
    output and lse, and for features inputs the float64 projection temporaries.
    """
    isz = np.dtype(plan.dtype).itemsize
    csz = 8 if plan.dtype == "float64" else 4
    h, hkv, d = plan.heads, plan.kv_heads, plan.head_dim
    qkv = n_local * (h + 2 * hkv) * d
    need = qkv * isz * (2 if prefetch else 1)
    need += qkv * csz  # head-major compute-dtype copies
    need += n_local * h * (d + 2) * csz  # acc, m, l
    need += 3 * 2 * n_local * hkv * d * csz  # K/V ring buffers
    need += n_local * h * d * isz + n_local * h * csz  # out, lse
    need += 3 * 256 * 1024 * h * csz  # tile scratch (scores, probabilities)
    if plan.mode == "features":
        f = plan.features
        need += n_local * f * (isz + 8) + f * (h + 2 * hkv) * d * 8 + qkv * 8
    return int(need)


def memory_budget(comm, limit: Optional[int] = None) -> int:
    """Bytes this rank may use: ``limit`` or 80% of the node's available memory / ranks on it."""
    if limit is not None:
        return int(limit)
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # a cgroup limit (batch systems) can be tighter than the node
        with open("/sys/fs/cgroup/memory.max") as fh:
            cg = fh.read().strip()
        if cg != "max":
            with open("/sys/fs/cgroup/memory.current") as fh:
                used = int(fh.read().strip())
            avail = min(avail or 1 << 62, int(cg) - used)
    except (OSError, ValueError):
        pass
    if avail is None:
        avail = 4 << 30
    local = 1
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_size()
        node.Free()
    return int(0.8 * avail / local)


def check_memory(plan: Plan, seq: SeqInfo, nranks: int, layout: str, budget: int) -> None:
    """Raise InputError if the rank with the most tokens of ``seq`` would exceed ``budget``."""
    n = int(counts(seq.length, nranks, layout).max())
    need = rank_bytes(plan, n)
    if need > budget:
        gib = 1 << 30
        _fail(
            plan.files[0],
            f"sequence {seq.name} (S={seq.length}, H={plan.heads}, D={plan.head_dim}) needs "
            f"~{need / gib:.2f} GiB per rank with {nranks} ranks, over the budget of "
            f"{budget / gib:.2f} GiB; use more ranks or raise --max-memory",
        )


def local_runs(pos: np.ndarray) -> list:
    """This rank's positions as (first_token, count, step, dest_offset) arithmetic runs."""
    out = []
    for a, b in runs(pos):
        step = int(pos[a + 1] - pos[a]) if b - a > 1 else 1
        out.append((int(pos[a]), b - a, step, a))
    return out


class Reader:
    """Reads one rank's tokens of each sequence, never more than its share.

    Parameters
    ----------
    plan : Plan
    rank, size : int
        This rank and the ring size.
    layout : str
        Token layout (see :mod:`ringmpi.partition`).
    strided : {"auto", "hyperslab", "blocks"}
        How a strided (striped layout) selection is read: one strided hyperslab
        per file, or contiguous blocks of ``block_bytes`` subsampled in memory.
        "auto" (default) picks the faster one measured here (jobs/read_throughput.py):
        hyperslab for contiguous storage (742 vs 618 MB/s per rank at P=2, cold),
        blocks for chunked/compressed storage (101 vs 32 MB/s), where a strided
        selection makes HDF5 walk every chunk element by element.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        size: int,
        layout: str,
        strided: str = "auto",
        block_bytes: int = 32 << 20,
    ):
        self.plan, self.rank, self.size, self.layout = plan, rank, size, layout
        self.strided, self.block_bytes = strided, block_bytes
        self._files: dict = {}
        self._weights = None
        self.bytes_read = 0

    def close(self) -> None:
        """Close the open input files."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, i: int):
        if i not in self._files:
            self._files[i] = _open(self.plan.files[i])
        return self._files[i]

    def positions(self, seq: SeqInfo) -> np.ndarray:
        """Global token positions this rank holds, shape (n_local,)."""
        return positions(seq.length, self.rank, self.size, self.layout)

    def _read_rows(self, seq: SeqInfo, name: str, pos: np.ndarray, dest: np.ndarray) -> None:
        """Fill ``dest`` (n_local, ...) with rows ``pos`` of dataset ``name`` across the shards."""
        offsets = seq.offsets
        for g0, cnt, step, o in local_runs(pos):
            for i, (f0, n) in enumerate(zip(offsets.tolist(), seq.lengths)):
                # indices t of the run g0 + step*t that fall in [f0, f0 + n)
                lo = max(0, -(-(f0 - g0) // step))
                hi = min(cnt, -(-(f0 + n - g0) // step))
                if lo >= hi:
                    continue
                node = self._file(i)
                ds = node[f"{seq.group}/{name}" if seq.group else name]
                s0 = g0 + step * lo - f0
                self._read_slice(ds, seq.batch, s0, hi - lo, step, dest[o + lo : o + hi], i, name)

    def _read_slice(self, ds, batch, s0, cnt, step, dest, i, name) -> None:
        def sel(a, b, st):
            sl = slice(a, b, st)
            return np.s_[batch, sl] if batch is not None else np.s_[sl]

        try:
            mode = self.strided
            if mode == "auto":  # measured: strided selections over chunked data are slow
                mode = "hyperslab" if ds.chunks is None else "blocks"
            if step == 1 or mode == "hyperslab":
                ds.read_direct(dest, source_sel=sel(s0, s0 + step * (cnt - 1) + 1, step))
                self.bytes_read += dest.nbytes
                return
            # contiguous blocks covering `per` strided rows each, subsampled in memory
            row = max(1, dest[0].nbytes)
            per = max(1, self.block_bytes // (row * step))
            buf = np.empty((per * step,) + dest.shape[1:], dest.dtype)
            for t in range(0, cnt, per):
                k = min(per, cnt - t)
                a = s0 + step * t
                span = step * (k - 1) + 1
                ds.read_direct(buf[:span], source_sel=sel(a, a + span, 1))
                dest[t : t + k] = buf[:span:step]
                self.bytes_read += buf[:span].nbytes
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            _fail(self.plan.files[i], f"cannot read dataset '{name}' ({msg})")

    def _load_weights(self) -> dict:
        if self._weights is None:
            f = _open(self.plan.weights)
            try:
                self._weights = {
                    n: np.asarray(f[n][...], dtype=np.float64) for n in ("wq", "wk", "wv")
                }
            finally:
                f.close()
        return self._weights

    def read(self, seq: SeqInfo, check_finite: bool = True) -> tuple:
        """Read this rank's q (n, H, D), k and v (n, Hkv, D) of ``seq`` in the input dtype.

        For features inputs, x (n, F) is read and projected in float64 on this
        rank only, then rounded to the input dtype.
        """
        plan = self.plan
        pos = self.positions(seq)
        n, h, hkv, d = len(pos), plan.heads, plan.kv_heads, plan.head_dim
        dt = np.dtype(plan.dtype)
        if plan.mode == "features":
            x = np.empty((n, plan.features), dt)
            self._read_rows(seq, "x", pos, x)
            w = self._load_weights()
            x64 = x.astype(np.float64)
            q = (x64 @ w["wq"]).astype(dt).reshape(n, h, d)
            k = (x64 @ w["wk"]).astype(dt).reshape(n, hkv, d)
            v = (x64 @ w["wv"]).astype(dt).reshape(n, hkv, d)
            arrays = {"x": x}
        else:
            q = np.empty((n, h, d), dt)
            k = np.empty((n, hkv, d), dt)
            v = np.empty((n, hkv, d), dt)
            for name, a in (("q", q), ("k", k), ("v", v)):
                self._read_rows(seq, name, pos, a)
            arrays = {"q": q, "k": k, "v": v}
        if check_finite:
            for name, a in arrays.items():
                bad = ~np.isfinite(a)
                if bad.any():
                    t = int(pos[np.argwhere(bad)[0][0]])
                    fi = int(np.searchsorted(seq.offsets, t, side="right") - 1)
                    _fail(
                        plan.files[fi],
                        f"sequence {seq.name}: '{name}' holds NaN or Inf (token {t})",
                    )
        return q, k, v
