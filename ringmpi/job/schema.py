"""HDF5 input schema: find the sequences in the input files and check that they fit together.

The input schema is documented in ``data/README.md``. In short, one or more HDF5
files hold the sequence(s) split along the sequence axis, in the order given:

* ``q`` (S, H, D), ``k`` and ``v`` (S, Hkv, D) at the root: one sequence;
* the same with a leading batch axis, ``q`` (B, S, H, D): B sequences;
* one group per sequence at the root, each holding ``q``, ``k``, ``v`` (S, ...);
* instead of q/k/v, raw features ``x`` (S, F) (or (B, S, F), or per group) plus
  a weights file with ``wq`` (F, H*D), ``wk`` and ``wv`` (F, Hkv*D), optional
  biases ``bq`` (H*D,), ``bk`` and ``bv`` (Hkv*D,), and root attributes
  ``num_heads`` and ``num_kv_heads``: q = x @ wq + bq, etc. (the (in, out)
  convention; a torch ``Linear.weight`` is (out, in): store its transpose);
* cross-attention: k and v (or key/value features ``x_kv``) with another length
  S_k than q (S_q); each dataset is concatenated over the shards along its own axis;
* packed sequences: an integer dataset ``cu_seqlens`` (n+1,) beside q (and
  ``cu_seqlens_k`` for cross-attention), offsets [0, n1, ..., S] on the global
  token axis, in the first shard (or identical in every shard); not with a batch axis.

Rank 0 scans the metadata of every file (:func:`scan`) and broadcasts a
:class:`Plan` (:func:`make_plan`) without its packed-sequence offsets, which each
rank reads itself (:mod:`ringmpi.job.offsets`); a problem becomes the same one-line
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

from ..collective import run_everywhere, run_on_root
from . import offsets, trust
from .inputs import InputError, check_offsets, fail, guarded, open_input
from .shares import merge as _merge
from .shares import scan_files as _scan_files
from .weights import read_weights

__all__ = [
    "InputError", "SeqInfo", "Plan", "expand_inputs", "open_input", "scan", "make_plan",
    "check_offsets", "fail",
]  # fmt: skip


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
        Number of query tokens of this sequence in each input file, in file order.
    lengths_k : list of int, optional
        Number of key/value tokens in each file (cross-attention); None: ``lengths``.
    cu_seqlens, cu_seqlens_k : int64 array (n+1,), optional
        Offsets of packed sequences on the global query / key token axis.
    x_kv : bool
        Features inputs: keys and values are projected from ``x_kv``, not ``x``.
    storage : tuple of dict, optional
        Per file, {dataset name: file offset of its bytes, or None}: where a
        contiguous dataset in the machine's byte order lies, so that the reader
        can fetch it without HDF5 (:func:`ringmpi.job.rawread.raw_offset`); None for
        a batch axis.
    """

    name: str
    group: str
    batch: Optional[int]
    lengths: list
    lengths_k: Optional[list] = None
    cu_seqlens: Optional[np.ndarray] = None
    cu_seqlens_k: Optional[np.ndarray] = None
    x_kv: bool = False
    storage: Optional[tuple] = None

    @property
    def length(self) -> int:
        """Total number of query tokens S (S_q)."""
        return int(sum(self.lengths))

    @property
    def length_k(self) -> int:
        """Total number of key/value tokens S_k (S unless cross-attention)."""
        return int(sum(self.lengths if self.lengths_k is None else self.lengths_k))

    @property
    def offsets(self) -> np.ndarray:
        """Global index of the first query token held by each file, shape (n_files,)."""
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)

    @property
    def offsets_k(self) -> np.ndarray:
        """Global index of the first key/value token held by each file, shape (n_files,)."""
        lk = self.lengths if self.lengths_k is None else self.lengths_k
        return np.concatenate(([0], np.cumsum(lk)[:-1])).astype(np.int64)

    @property
    def cross(self) -> bool:
        """Whether q and k/v have different lengths."""
        return self.length != self.length_k

    @property
    def packed(self) -> bool:
        """Whether the sequence holds packed sequences (``cu_seqlens``)."""
        return self.cu_seqlens is not None


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
    sinks: Optional[tuple] = None  # per-head sink logits (H,) from the weights file
    # per file: the (device, inode), (size, mtime, ctime) whose every link the ranks walked
    # together, or None (ringmpi.job.inputs.links_known)
    walked: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        """Length of the batch axis (0 unless structure == "batch")."""
        return len(self.sequences) if self.structure == "batch" else 0


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


def _check_qkv(path: str, g: str, info: dict, extra: int) -> tuple:
    where = f"group '{g}': " if g else ""
    (qs, qt), (ks, kt), (vs, vt) = info["q"], info["k"], info["v"]
    if not (qt == kt == vt):
        fail(path, f"{where}q, k, v dtypes differ ({qt}, {kt}, {vt})")
    if ks != vs:
        fail(path, f"{where}k has shape {ks} but v has shape {vs}")
    if extra and qs[0] != ks[0]:
        fail(path, f"{where}batch sizes differ: q has {qs[0]}, k has {ks[0]}")
    # q and k/v may differ in length (cross-attention)
    h, d = qs[-2:]
    hkv, dk = ks[-2:]
    if d != dk:
        fail(path, f"{where}head dim mismatch: q has D={d}, k and v have D={dk}")
    if h < 1 or hkv < 1 or d < 1:
        fail(path, f"{where}empty head axis: q {qs}, k {ks}")
    if h % hkv:
        fail(path, f"{where}H={h} query heads is not a multiple of Hkv={hkv} key/value heads")
    return (qs[extra], ks[extra]), (h, hkv, d), qt, (qs[0] if extra else None)


def scan(files: Sequence[str], weights: Optional[str] = None, metas: Optional[list] = None) -> Plan:
    """Read the metadata of every input file and check that they form valid sequences.

    Parameters
    ----------
    files : list of str
        Input files in sequence order (shards along the sequence axis).
    weights : str, optional
        Weights file for raw-feature inputs.
    metas : list of dict, optional
        What :func:`ringmpi.job.inputs.scan_file` gave for each file, already read
        (:func:`make_plan`: by all ranks together); default: read here.

    Returns
    -------
    Plan

    Raises
    ------
    InputError
        One line naming the file and the problem.
    """
    files = [str(p) for p in files]
    metas = _scan_files(files) if metas is None else metas
    structure = metas[0]["structure"]
    first = metas[0]
    mode = first["mode"]
    extra = 1 if structure == "batch" else 0
    names = [g for g, _ in first["seqs"]]
    first_info = dict(first["seqs"])  # group -> its facts (a lookup per group, not a scan)
    w = None
    if mode == "features":
        if weights is None:
            fail(files[0], "holds raw features 'x'; give the projection weights with --weights")
        w = guarded(weights, read_weights, weights)
    elif weights is not None:
        fail(weights, f"weights given but {files[0]} holds q, k, v (weights need features 'x')")
    per_seq: dict = {g: [] for g in names}
    at: dict = {g: [] for g in names}  # per file: where the datasets' bytes lie
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
                n, b = (shape[extra], shape[extra]), (shape[0] if extra else None)
                if shape[-1] != w["features"]:
                    fail(
                        p,
                        f"x has {shape[-1]} features but {weights} expects {w['features']}"
                        " (weights are (in, out): q = x @ wq; torch Linear weights need .T)",
                    )
                if ("x_kv" in info) != ("x_kv" in first_info[g]):
                    fail(p, "shards do not line up: x_kv present in some shards, not in others")
                if "x_kv" in info:
                    kshape, kdt = info["x_kv"]
                    if kdt != dt or kshape[-1] != shape[-1] or (extra and kshape[0] != shape[0]):
                        fail(p, f"x_kv {kshape} {kdt} does not fit x {shape} {dt}")
                    n = (shape[extra], kshape[extra])
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
            per_seq[g].append((int(n[0]), int(n[1])))
            at[g].append(info.get("at"))
    cus = {g: offsets.of_group(files, metas, j, g, per_seq[g]) for j, g in enumerate(names)}
    lq = {g: [a for a, _ in per_seq[g]] for g in names}
    lk = {g: [b for _, b in per_seq[g]] for g in names}
    warnings = []
    if mode == "qkv":
        h = geom[0]
        short = [g for g in names if sum(lq[g]) < h]
        if short:
            g = short[0]
            where = f"group '{g}': " if g else ""
            warnings.append(
                f"{files[0]}: {where}q has S={sum(lq[g])} tokens but H={h} heads: the "
                "schema is token-major, q (S, H, D); if the data is head-major (H, S, D), "
                "transpose it (np.swapaxes(q, 0, 1)) or the heads are taken as tokens"
            )

    def kl(g):
        return None if lk[g] == lq[g] else list(lk[g])

    if structure == "batch":
        xkv = "x_kv" in first["seqs"][0][1]
        seqs = [SeqInfo(f"b={i}", "", i, list(lq[""]), kl(""), x_kv=xkv) for i in range(batch)]
    else:
        seqs = [
            SeqInfo(g or "seq", g, None, lq[g], kl(g), *cus[g], "x_kv" in first_info[g],
                    storage=tuple(at[g]) if all(a is not None for a in at[g]) else None)
            for g in names
        ]  # fmt: skip
    if not seqs:
        fail(files[0], "batch axis has no sequence")
    for s in seqs:
        if s.length == 0:
            fail(files[0], f"sequence {s.name} has no token")
        if s.length_k == 0:
            fail(files[0], f"sequence {s.name} has no key/value token")
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
        sinks=w.get("sinks") if w else None,
    )


def make_plan(
    comm,
    inputs: Sequence[str],
    weights: Optional[str],
    nranks: int,
    rope: bool = False,
) -> Plan:
    """Every rank scans a share of the inputs' groups, rank 0 builds the Plan; every rank
    gets the Plan or the same InputError.

    ``rope``: the run applies rotary embeddings, which needs features inputs
    (x + weights) and an even head dimension.
    """
    shares: list = []
    if comm is not None and comm.Get_size() > 1:  # the groups' metadata read by all ranks
        files = run_on_root(comm, expand_inputs, inputs)
        part = (comm.Get_rank(), comm.Get_size())
        mine = run_everywhere(comm, _scan_files, files, part)
        shares = comm.gather(mine, root=0) or []

    def build():
        if shares:
            metas = _merge(shares, files)
            plan = scan(files, weights, metas=metas)
            plan.walked = [m.get("identity") for m in metas]
        else:
            plan = scan(expand_inputs(inputs), weights)
        for s in plan.sequences:
            n = min(s.length, s.length_k)
            if n < nranks:
                fail(plan.files[0], f"sequence {s.name} has {n} tokens, fewer than {nranks} ranks")
        if rope and plan.mode != "features":
            fail(plan.files[0], "--rope rotates the projected q and k of features inputs (x + "
                 "--weights); this input holds q, k, v, taken as already rotated: rotate them "
                 "with ringmpi.rope.apply_rope before writing, or give features")  # fmt: skip
        if rope and plan.head_dim % 2:
            fail(plan.weights, f"--rope needs an even head dimension, D={plan.head_dim}")
        if comm is None or comm.Get_size() == 1:
            return plan
        full.append(plan)
        return offsets.strip(plan)  # offsets stay out of the broadcast: each rank reads them

    full: list = []
    got = run_on_root(comm, build)
    if comm is None or comm.Get_size() == 1:
        return got
    mine = (lambda *_: full[0]) if comm.Get_rank() == 0 else offsets.fill
    plan = run_everywhere(comm, mine, *got)
    for ident in plan.walked:  # every link walked by the ranks together: the reader need not
        if ident is not None:
            trust.links_known(ident)
    return plan
