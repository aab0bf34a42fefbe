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
  token axis, in the first shard (or identical in every shard); not with a batch axis;
* a mask of slices (issue 41): an integer dataset ``slices`` (n, 5) beside q,
  rows (q_start, q_end, k_start, k_end, kind code) over the sequence's global
  positions (:func:`ringmpi.job.input.files.read_slices`), the sequence's whole
  mask; in the first shard (or identical in every shard); not with a batch axis
  or ``cu_seqlens``.

Rank 0 scans the metadata of every file (:func:`scan`) and broadcasts a
:class:`Plan` (:func:`make_plan`) without its packed-sequence offsets, which each
rank reads itself (:mod:`ringmpi.job.input.scan`); a problem becomes the same one-line
:class:`InputError` on every rank. Reading is :mod:`ringmpi.job.input.reader`, the
memory budget :mod:`ringmpi.job.resources`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from ...collective import run_everywhere, run_on_root
from ...runtime import interrupt
from ...slices import Slices
from ..plan import InputError, Plan, SeqInfo, digest, fail
from . import files as input_files
from .files import check_offsets, check_slices, guarded
from .weights import read_weights

__all__ = [
    "expand_inputs",
    "scan",
    "make_plan",
    "strip",
    "fill",
    "digest",
    "of_group",
    "slices_of",
    "scan_files",
    "merge",
]


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
    # v may be narrower or wider than k (multi-head latent attention), in nothing else
    if ks[:-1] != vs[:-1]:
        fail(path, f"{where}k has shape {ks} but v has shape {vs} (only the last axes may differ)")
    if extra and qs[0] != ks[0]:
        fail(path, f"{where}batch sizes differ: q has {qs[0]}, k has {ks[0]}")
    # q and k/v may differ in length (cross-attention)
    h, d = qs[-2:]
    hkv, dk = ks[-2:]
    dv = vs[-1]
    if d != dk:
        fail(path, f"{where}head dim mismatch: q has D={d}, k has D={dk}")
    if h < 1 or hkv < 1 or d < 1 or dv < 1:
        fail(path, f"{where}empty head axis: q {qs}, k {ks}")
    if h % hkv:
        fail(path, f"{where}H={h} query heads is not a multiple of Hkv={hkv} key/value heads")
    return (qs[extra], ks[extra]), (h, hkv, d, dv), qt, (qs[0] if extra else None)


def scan(files: Sequence[str], weights: Optional[str] = None, metas: Optional[list] = None) -> Plan:
    """Read the metadata of every input file and check that they form valid sequences.

    Parameters
    ----------
    files : list of str
        Input files in sequence order (shards along the sequence axis).
    weights : str, optional
        Weights file for raw-feature inputs.
    metas : list of dict, optional
        What :func:`ringmpi.job.input.files.scan_file` gave for each file, already read
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
    metas = scan_files(files) if metas is None else metas
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
                gm = (w["heads"], w["kv_heads"], w["head_dim"], w["value_dim"])
            where = f" (group '{g}')" if g else ""
            if geom is None:
                geom, dtype, batch = gm, dt, b
            if gm != geom:
                fail(
                    p,
                    f"shards do not line up: (H, Hkv, Dk, Dv) = {gm}{where}, "
                    f"first input has {geom}",
                )
            if dt != dtype:
                fail(p, f"shards do not line up: dtype {dt}{where}, first input has {dtype}")
            if b != batch:
                fail(p, f"shards do not line up: batch size {b}, first input has {batch}")
            per_seq[g].append((int(n[0]), int(n[1])))
            at[g].append(info.get("at"))
    cus = {g: of_group(files, metas, j, g, per_seq[g]) for j, g in enumerate(names)}
    masks = {g: slices_of(files, metas, j, g, per_seq[g]) for j, g in enumerate(names)}
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
            SeqInfo(
                g or "seq",
                g,
                None,
                lq[g],
                kl(g),
                *cus[g],
                "x_kv" in first_info[g],
                storage=tuple(at[g]) if all(a is not None for a in at[g]) else None,
                slices=masks[g],
            )
            for g in names
        ]
    if not seqs:
        fail(files[0], "batch axis has no sequence")
    for s in seqs:
        if s.length == 0:
            fail(files[0], f"sequence {s.name} has no token")
        if s.length_k == 0:
            fail(files[0], f"sequence {s.name} has no key/value token")
    h, hkv, d, dv = geom
    return Plan(
        files=files,
        mode=mode,
        structure=structure,
        heads=h,
        kv_heads=hkv,
        head_dim=d,
        value_dim=dv,
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
        mine = run_everywhere(comm, scan_files, files, part)
        shares = comm.gather(mine, root=0) or []

    def build():
        if shares:
            metas = merge(shares, files)
            plan = scan(files, weights, metas=metas)
            plan.walked = [m.get("identity") for m in metas]
        else:
            plan = scan(expand_inputs(inputs), weights)
        for s in plan.sequences:
            n = min(s.length, s.length_k)
            if n < nranks:
                fail(plan.files[0], f"sequence {s.name} has {n} tokens, fewer than {nranks} ranks")
        if rope and plan.mode != "features":
            fail(
                plan.files[0],
                "--rope rotates the projected q and k of features inputs (x + "
                "--weights); this input holds q, k, v, taken as already rotated: rotate them "
                "with ringmpi.rope.apply_rope before writing, or give features",
            )
        if rope and plan.head_dim % 2:
            fail(plan.weights, f"--rope needs an even head dimension, D={plan.head_dim}")
        if comm is None or comm.Get_size() == 1:
            return plan
        full.append(plan)
        return strip(plan)  # offsets stay out of the broadcast: each rank reads them

    full: list = []
    got = run_on_root(comm, build)
    if comm is None or comm.Get_size() == 1:
        return got
    mine = (lambda *_: full[0]) if comm.Get_rank() == 0 else fill
    plan = run_everywhere(comm, mine, *got)
    for ident in plan.walked:  # every link walked by the ranks together: the reader need not
        if ident is not None:
            input_files.links_known(ident)
    return plan


# ----------------------------------------------------------------------
# Packed-sequence offsets stay out of the plan's broadcast: every rank reads them itself.
#
# Rank 0 scans the inputs and broadcasts the :class:`ringmpi.job.plan.Plan` as a
# pickle. A ``cu_seqlens`` may hold up to ``MAX_PACKED`` + 1 offsets per group, and an
# input may have many groups: pickled into that one broadcast they would cost rank 0
# a copy of all of them at once, and every rank the whole pickle before anything is
# checked. Instead :func:`strip` replaces each offsets array by its length and
# SHA-256; each other rank then reads the arrays from the first input itself, with
# the same bounded slab reads and checks as rank 0 (:func:`ringmpi.job.input.files.read_offsets`),
# and :func:`fill` refuses, on every rank alike, an array that differs from what rank 0
# checked (the file changed while the job was planning).


NAMES = ("cu_seqlens", "cu_seqlens_k")
# the per-sequence arrays kept out of the broadcast: the offsets, and the mask of slices
# (issue 41: a Slices, its digest that of its sorted table)
STRIPPED = NAMES + ("slices",)


def strip(plan):
    """(plan without offsets arrays, {(sequence index, name): (entries, sha256)}).

    Parameters
    ----------
    plan : Plan
        As :func:`ringmpi.job.input.scan.scan` built it; left unchanged.
    """
    sums: dict = {}
    seqs = []
    for i, s in enumerate(plan.sequences):
        gone = {}
        for name in STRIPPED:
            cu = getattr(s, name)
            if cu is not None:
                sums[(i, name)] = digest(cu)
                gone[name] = None
        seqs.append(replace(s, **gone) if gone else s)
    return replace(plan, sequences=seqs), sums


def fill(plan, sums: dict):
    """The plan with its offsets arrays read from the first input and checked against ``sums``.

    Raises InputError naming the file when an array cannot be read, fails the
    checks, or differs from the one rank 0 checked.

    Parameters
    ----------
    plan : Plan
        A plan from :func:`strip` (offsets missing).
    sums : dict
        ``{(sequence index, name): (entries, sha256)}`` from :func:`strip`.
    """
    from ...runtime import interrupt

    if not sums:
        return plan
    path = plan.files[0]
    f = input_files.open_input(path)
    try:
        fsize = os.path.getsize(path)
        seqs = list(plan.sequences)
        for (i, name), (n, sha) in sorted(sums.items()):
            interrupt.check()
            s = seqs[i]
            node = f[s.group] if s.group else f
            if name not in node:
                gone = "is gone (the file changed while the job was planning)"
                fail(path, f"'{name}' of sequence {s.name} {gone}")
            if name == "slices":
                cu = Slices(input_files.read_slices(path, node, fsize))
            else:
                cu = input_files.read_offsets(path, node, name, fsize, n - 1)
            if digest(cu) != (n, sha):
                fail(
                    path,
                    f"'{name}' of sequence {s.name} differs from what rank 0 checked "
                    "(the file changed while the job was planning)",
                )
            seqs[i] = replace(s, **{name: cu})
        return replace(plan, sequences=seqs)
    finally:
        f.close()


def of_group(files, metas, index: int, g: str, per_file: list) -> tuple:
    """(cu_seqlens, cu_seqlens_k) of group ``g`` for the scan (:func:`ringmpi.job.input.scan.scan`):
    from the first shard, identical in the others."""
    where = f"group '{g}': " if g else ""
    cu, cu_k = (_same_in_every_shard(files, metas, index, where, n) for n in NAMES)
    if cu is None and cu_k is not None:
        fail(files[0], f"{where}'cu_seqlens_k' needs 'cu_seqlens' (the query offsets)")
    if cu is None:
        return None, None
    n_q, n_k = sum(a for a, _ in per_file), sum(b for _, b in per_file)
    check_offsets(files[0], where, "cu_seqlens", cu, n_q)
    if cu_k is None and n_k != n_q:
        fail(
            files[0],
            f"{where}q has {n_q} tokens, k/v {n_k}: packed cross-attention needs "
            "'cu_seqlens_k' (key/value offsets) beside 'cu_seqlens'",
        )
    if cu_k is not None:
        check_offsets(files[0], where, "cu_seqlens_k", cu_k, n_k)
        if len(cu_k) != len(cu):
            fail(
                files[0],
                f"{where}'cu_seqlens' has {len(cu) - 1} sequences but "
                f"'cu_seqlens_k' has {len(cu_k) - 1}",
            )
    return cu, cu_k


def _same_in_every_shard(files, metas, index: int, where: str, name: str):
    """Sequence ``index``'s small dataset ``name`` (offsets, slices) as the first shard holds
    it; a shard holding another one, or holding it where the first does not, fails."""
    first = metas[0]["seqs"][index][1].get(name)
    for p, meta in zip(files[1:], metas[1:]):
        other = meta["seqs"][index][1].get(name)
        if other is None:
            continue
        if first is None:
            fail(p, f"{where}'{name}' must be in the first shard {files[0]} (or in all)")
        if other.shape != first.shape or (other != first).any():
            fail(p, f"{where}'{name}' differs from the one in {files[0]}")
    return first


def slices_of(files, metas, index: int, g: str, per_file: list) -> Optional[Slices]:
    """The mask of slices of group ``g`` for the scan: from the first shard, identical in the
    others, within the sequence's lengths, not with packed sequences; None without one."""
    where = f"group '{g}': " if g else ""
    first = _same_in_every_shard(files, metas, index, where, "slices")
    if first is None:
        return None
    info = metas[0]["seqs"][index][1]
    if "cu_seqlens" in info or "cu_seqlens_k" in info:
        fail(
            files[0],
            f"{where}'slices' is the sequence's whole mask: it cannot be combined with "
            "'cu_seqlens' (write the packed sequences' blocks as slices instead)",
        )
    n_q, n_k = sum(a for a, _ in per_file), sum(b for _, b in per_file)
    check_slices(files[0], where, first, n_q, n_k)
    return Slices(first)


# ----------------------------------------------------------------------
# The plan scan shared by a job's ranks: each scans a share of every file, rank 0 merges.
#
# :func:`scan_files` reads the metadata of every input file, or with ``part=(r, n)`` this
# rank's share of it (:func:`ringmpi.job.input.files.scan_file`: the root's entries ``r::n``,
# the links below them walked first); :func:`merge` puts the shares back together as the
# whole scan would have read them (:func:`ringmpi.job.input.scan.make_plan`), and checks what
# no share can alone: the kinds of data agree, the links walked stay under the limit, every
# rank saw the same file.


def scan_files(files: list, part: Optional[tuple] = None) -> list:
    """:func:`ringmpi.job.input.files.scan_file` of every file (``part``: this rank's share)."""
    metas, structure = [], None
    for p in files:
        interrupt.check()
        metas.append(guarded(p, input_files.scan_file, p, structure, part))
        structure = metas[0]["structure"]
    return metas


def merge(shares: list, files: list) -> list:
    """The metas of every file from each rank's share (:func:`scan_files` with ``part``).

    The shares' link walks add up to the file's (``MAX_LINKS`` applies to the sum); a
    file every rank saw as the same (device, inode, size, times) gets ``identity``: its
    links are known walked (:func:`ringmpi.job.input.files.links_known`).
    """
    out = []
    for path, per_rank in zip(files, zip(*shares)):
        meta = dict(per_rank[0])
        modes = {m["mode"] for m in per_rank} - {None}  # each share's, from its first group
        if len(modes) > 1:
            fail(path, "holds groups of q, k, v and groups of features x: one kind per file")
        if not modes:
            f = input_files.open_input(path)
            try:
                fail(path, input_files.no_data(f))
            finally:
                f.close()
        meta["mode"] = modes.pop()
        seqs = [sq for m in per_rank for sq in m["seqs"]]
        meta["seqs"] = sorted(seqs, key=lambda sq: sq[0])  # the groups' sorted order again
        if sum(m.get("links", 0) for m in per_rank) > input_files.MAX_LINKS:
            fail(path, f"holds more than {input_files.MAX_LINKS} links")
        seen = {m.get("identity") for m in per_rank}
        meta["identity"] = seen.pop() if len(seen) == 1 else None
        out.append(meta)
    return out
