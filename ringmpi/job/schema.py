"""HDF5 input schema: find the sequences in the input files and check that they fit together.

The input schema is documented in ``data/README.md``. In short, one or more HDF5
files hold the sequence(s) split along the sequence axis, in the order given:

* ``q`` (S, H, D), ``k`` and ``v`` (S, Hkv, D) at the root: one sequence;
* the same with a leading batch axis, ``q`` (B, S, H, D): B sequences;
* one group per sequence at the root, each holding ``q``, ``k``, ``v`` (S, ...);
* instead of q/k/v, raw features ``x`` (S, F) (or (B, S, F), or per group) plus
  a weights file with ``wq`` (F, H*D), ``wk`` and ``wv`` (F, Hkv*D) and root
  attributes ``num_heads`` and ``num_kv_heads``: q = x @ wq, etc.

Rank 0 scans the metadata of every file (:func:`scan`) and broadcasts a
:class:`Plan` (:func:`make_plan`); a problem becomes the same one-line
:class:`InputError` on every rank. Reading is :mod:`ringmpi.job.reader`, the
memory budget :mod:`ringmpi.job.budget`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..collective import CollectiveError, run_on_root

__all__ = ["InputError", "SeqInfo", "Plan", "expand_inputs", "open_input", "scan", "make_plan"]

FLOAT_DTYPES = ("float16", "float32", "float64")
# Any declared dimension above this is treated as corrupt rather than merely large.
MAX_DIM = 1 << 40


class InputError(CollectiveError):
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
    warnings: list = field(default_factory=list)  # one line each, printed by the job

    @property
    def batch_size(self) -> int:
        """Length of the batch axis (0 unless structure == "batch")."""
        return len(self.sequences) if self.structure == "batch" else 0


def fail(path: str, problem: str):
    """Raise InputError "PATH: PROBLEM"."""
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


def open_input(path: str):
    """Open an HDF5 file for reading (no locking); InputError naming the file if it cannot."""
    import h5py

    if not os.path.exists(path):
        fail(path, "no such file")
    if os.path.isdir(path):
        fail(path, "is a directory, not an HDF5 file")
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        reason = str(e).split("(", 1)[-1].rstrip(")") if "(" in str(e) else str(e)
        fail(path, f"cannot open as HDF5 (truncated or not an HDF5 file: {reason})")


def _check_storage(path: str, ds, size: int) -> None:
    """Refuse declared shapes that cannot be real and data that lies past the end of file."""
    for n in ds.shape:
        if n > MAX_DIM:
            fail(path, f"dataset '{ds.name}' declares an absurd shape {ds.shape}")
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
        fail(path, f"dataset '{ds.name}' has unreadable storage metadata ({e})")
    if end > size:
        fail(path, f"dataset '{ds.name}' extends past the end of the file (truncated?)")


def _dataset(path: str, f, name: str, ndim: int, fsize: int):
    import h5py

    try:
        obj = f.get(name)
    except (KeyError, OSError, RuntimeError) as e:
        fail(path, f"cannot open dataset '{name}' ({e})")
    if obj is None:
        fail(path, f"missing dataset '{name}'")
    if not isinstance(obj, h5py.Dataset):
        fail(path, f"'{name}' is not a dataset")
    if obj.dtype.kind != "f" or obj.dtype.name not in FLOAT_DTYPES:
        fail(path, f"dataset '{name}' has dtype {obj.dtype}, expected float16, float32 or float64")
    if obj.ndim != ndim:
        fail(path, f"dataset '{name}' has shape {obj.shape}, expected {ndim} dimensions")
    _check_storage(path, obj, fsize)
    return obj


def _scan_file(path: str, structure_hint: Optional[str]) -> dict:
    """Metadata of one file: {"mode", "structure", "seqs": [(group, batch, shapes)], ...}."""
    f = open_input(path)
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
                where = "at the root or in any group"
                fail(path, f"no dataset 'q' (or features 'x') {where}; {_found(f)}")
        if structure_hint and structure != structure_hint:
            problem = f"{structure} structure, first input is {structure_hint}"
            fail(path, f"shards do not line up: {problem}")
        mode = "qkv" if "q" in (f[groups[0]] if groups[0] else f) else "features"
        extra = 1 if structure == "batch" else 0
        seqs = []
        for g in groups:
            node = f[g] if g else f
            if mode == "qkv":
                shapes = {n: _dataset(path, node, n, 3 + extra, fsize) for n in ("q", "k", "v")}
            else:
                if "q" in node:
                    fail(path, f"group '{g}' holds q but others hold features x")
                shapes = {"x": _dataset(path, node, "x", 2 + extra, fsize)}
            info = {n: (d.shape, d.dtype.name) for n, d in shapes.items()}
            seqs.append((g, info))
        return {"mode": mode, "structure": structure, "seqs": seqs}
    finally:
        f.close()


def _found(f, limit: int = 8) -> str:
    """'found: a (10, 4) float32, grp/b (3,) int64, ...' for an error message."""
    import h5py

    items = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            items.append(f"{name} {obj.shape} {obj.dtype}")
        return None if len(items) <= limit else True

    try:
        f.visititems(visit)
    except Exception:  # noqa: BLE001 - a damaged file: say what could be listed
        pass
    if not items:
        return "the file holds no dataset"
    more = f", ... ({len(items) - limit}+ more)" if len(items) > limit else ""
    return "found: " + ", ".join(items[:limit]) + more


def _check_qkv(path: str, g: str, info: dict, extra: int) -> tuple:
    where = f"group '{g}': " if g else ""
    (qs, qt), (ks, kt), (vs, vt) = info["q"], info["k"], info["v"]
    if not (qt == kt == vt):
        fail(path, f"{where}q, k, v dtypes differ ({qt}, {kt}, {vt})")
    if ks != vs:
        fail(path, f"{where}k has shape {ks} but v has shape {vs}")
    if extra and qs[0] != ks[0]:
        fail(path, f"{where}batch sizes differ: q has {qs[0]}, k has {ks[0]}")
    if qs[extra] != ks[extra]:
        fail(path, f"{where}length mismatch: q has {qs[extra]} tokens, k and v have {ks[extra]}")
    h, d = qs[-2:]
    hkv, dk = ks[-2:]
    if d != dk:
        fail(path, f"{where}head dim mismatch: q has D={d}, k and v have D={dk}")
    if h < 1 or hkv < 1 or d < 1:
        fail(path, f"{where}empty head axis: q {qs}, k {ks}")
    if h % hkv:
        fail(path, f"{where}H={h} query heads is not a multiple of Hkv={hkv} key/value heads")
    return qs[extra], (h, hkv, d), qt, (qs[0] if extra else None)


def _read_weights(path: str) -> dict:
    f = open_input(path)
    try:
        fsize = os.path.getsize(path)
        w = {n: _dataset(path, f, n, 2, fsize) for n in ("wq", "wk", "wv")}
        try:
            h, hkv = int(f.attrs["num_heads"]), int(f.attrs["num_kv_heads"])
        except (KeyError, TypeError, ValueError):
            fail(path, "needs integer root attributes 'num_heads' and 'num_kv_heads'")
        fq, nq = w["wq"].shape
        fk, nk = w["wk"].shape
        if w["wv"].shape != (fk, nk):
            fail(path, f"wk has shape {w['wk'].shape} but wv has shape {w['wv'].shape}")
        if fq != fk:
            fail(path, f"wq has {fq} input features but wk and wv have {fk}")
        if h < 1 or hkv < 1 or nq % h or nk % hkv or nq // max(h, 1) != nk // max(hkv, 1):
            fail(path, f"wq {w['wq'].shape}, wk {w['wk'].shape} do not fit H={h}, Hkv={hkv}")
        if h % hkv:
            fail(path, f"num_heads={h} is not a multiple of num_kv_heads={hkv}")
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
        fail(path, f"unreadable HDF5 metadata ({type(e).__name__}: {msg})")


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
            fail(files[0], "holds raw features 'x'; give the projection weights with --weights")
        w = _guarded(weights, _read_weights, weights)
    elif weights is not None:
        fail(weights, f"weights given but {files[0]} holds q, k, v (weights need features 'x')")
    per_seq: dict = {g: [] for g in names}
    geom = dtype = batch = None
    for p, meta in zip(files, metas):
        if meta["mode"] != mode:
            fail(p, f"shards do not line up: {meta['mode']} data, {files[0]} holds {mode}")
        got = [g for g, _ in meta["seqs"]]
        if got != names:
            missing = sorted(set(names) ^ set(got))
            fail(p, f"shards do not line up: groups differ from {files[0]} ({', '.join(missing)})")
        for g, info in meta["seqs"]:
            if mode == "qkv":
                n, gm, dt, b = _check_qkv(p, g, info, extra)
            else:
                shape, dt = info["x"]
                n, b = shape[extra], (shape[0] if extra else None)
                if shape[-1] != w["features"]:
                    fail(p, f"x has {shape[-1]} features but {weights} expects {w['features']}")
                gm = (w["heads"], w["kv_heads"], w["head_dim"])
            where = f" (group '{g}')" if g else ""
            if geom is None:
                geom, dtype, batch = gm, dt, b
            if gm != geom:
                fail(p, f"shards do not line up: (H, Hkv, D) = {gm}{where}, first input has {geom}")
            if dt != dtype:
                fail(p, f"shards do not line up: dtype {dt}{where}, first input has {dtype}")
            if b != batch:
                fail(p, f"shards do not line up: batch size {b}, first input has {batch}")
            per_seq[g].append(int(n))
    warnings = []
    if mode == "qkv":
        h = geom[0]
        short = [g for g in names if sum(per_seq[g]) < h]
        if short:
            g = short[0]
            where = f"group '{g}': " if g else ""
            warnings.append(
                f"{files[0]}: {where}q has S={sum(per_seq[g])} tokens but H={h} heads: the "
                "schema is token-major, q (S, H, D); if the data is head-major (H, S, D), "
                "transpose it (np.swapaxes(q, 0, 1)) or the heads are taken as tokens"
            )
    if structure == "batch":
        seqs = [SeqInfo(f"b={i}", "", i, list(per_seq[""])) for i in range(batch)]
    else:
        seqs = [SeqInfo(g or "seq", g, None, per_seq[g]) for g in names]
    if not seqs:
        fail(files[0], "batch axis has no sequence")
    for s in seqs:
        if s.length == 0:
            fail(files[0], f"sequence {s.name} has no token")
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
        warnings=warnings,
    )


def make_plan(comm, inputs: Sequence[str], weights: Optional[str], nranks: int) -> Plan:
    """Rank 0 expands and scans the inputs; every rank gets the Plan or the same InputError."""

    def build():
        plan = scan(expand_inputs(inputs), weights)
        for s in plan.sequences:
            if s.length < nranks:
                fail(
                    plan.files[0],
                    f"sequence {s.name} has {s.length} tokens, fewer than {nranks} ranks",
                )
        return plan

    return run_on_root(comm, build)
