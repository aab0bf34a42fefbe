"""The virtual-dataset file of the part-file output: every sequence in global token order.

``OUT.h5`` holds, per sequence, virtual datasets ``out`` (S, H, D) and ``lse``
(H, S) mapping each run of a rank's tokens to its rows in the part file of the
batch holding the sequence (:mod:`ringmpi.job.store`); NaN is the fill value,
so a copy without its parts reads NaN, never zeros. Rank 0 writes it once,
in one pass over the sequences, with the HDF5 mapping calls directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..files import exclusive_temp, fsync_path
from ..partition import counts, positions
from .outdir import vds_name
from .reader import local_runs
from .schema import Plan

__all__ = [
    "INDEX",
    "write_vds",
    "publish_vds",
    "virtual_dataset",
    "label_dims",
    "write_offsets",
    "part_name",
]


INDEX = "index.h5"  # the name the file built ahead is a temporary of, in the parts folder


def part_name(seq_index: int, rank: int) -> str:
    """File name of one rank's part of the batch starting at sequence ``seq_index``."""
    return f"s{seq_index:06d}.r{rank:05d}.h5"


@dataclass
class _Parts:
    """What the mapping needs to know of the part files."""

    plan: Plan
    attrs: dict
    parts: str
    size: int
    layout: str
    nranks: dict  # first member of a batch -> ranks that wrote it (default size)


def virtual_dataset(node, name: str, shape: tuple, dtype, maps: list, cache=None):
    """A virtual dataset from low-level mappings, with NaN fill and no modification time.

    ``node``: an h5py group or its low-level ``GroupID``; returns the new ``DatasetID``.

    ``maps``: (target start, count, stride, block, source file, source shape,
    source start, source block) hyperslabs, one per run of tokens (built with
    the HDF5 calls directly: h5py's VirtualSource slicing costs milliseconds
    per run, which made the file of 10,000 sequences take minutes). ``cache``: a
    dict kept by the caller over many calls, holding each dtype's HDF5 type and a
    template creation property list (copied per dataset: a fifth of the cost).
    """
    from h5py import h5d, h5p, h5s, h5t
    from h5py._objects import ObjectID

    dt = np.dtype(dtype)
    cache = {} if cache is None else cache
    if dt not in cache:
        base = h5p.create(h5p.DATASET_CREATE)
        base.set_layout(h5d.VIRTUAL)
        base.set_obj_track_times(False)  # reruns: the same bytes
        base.set_fill_value(np.array(np.nan, dtype=dt))
        cache[dt] = (base, h5t.py_create(dt, logical=1))
    base, tid = cache[dt]
    dcpl = base.copy()
    src_name = name.encode()
    for start, count, stride, block, fname, src_shape, src_start, src_block in maps:
        vspace = h5s.create_simple(shape)
        vspace.select_hyperslab(start, count, stride, block)
        sspace = h5s.create_simple(src_shape)
        sspace.select_hyperslab(src_start, (1,) * len(src_shape), None, src_block)
        dcpl.set_virtual(vspace, fname.encode(), src_name, sspace)
    gid = node if isinstance(node, ObjectID) else node.id  # a GroupID's .id is its number
    return h5d.create(gid, name=src_name, tid=tid, space=h5s.create_simple(shape), dcpl=dcpl)


def label_dims(node, batch: bool) -> None:
    """Name the axes of ``out`` (token, head, head_dim) and ``lse`` (head, token)."""
    label_ids(node["out"].id, node["lse"].id, batch)


def label_ids(out_id, lse_id, batch: bool) -> None:
    """:func:`label_dims` on the low-level ``DatasetID`` s of ``out`` and ``lse``.

    The labels are what ``H5DSset_label`` stores (the attribute ``DIMENSION_LABELS``: one
    variable-length ASCII string per axis, read back by ``ds.dims[axis].label``), written
    in one attribute write per dataset instead of a rewrite per axis.
    """
    import h5py
    from h5py import h5a, h5s, h5t

    tid = h5t.C_S1.copy()
    tid.set_size(h5t.VARIABLE)
    lead = (b"sequence",) if batch else ()
    for dsid, labels in ((out_id, _OUT_AXES), (lse_id, _LSE_AXES)):
        names = np.array(lead + labels, dtype=h5py.string_dtype("ascii"))
        attr = h5a.create(dsid, b"DIMENSION_LABELS", tid, h5s.create_simple((len(names),)))
        attr.write(names)


_OUT_AXES = (b"token", b"head", b"head_dim")
_LSE_AXES = (b"head", b"token")


def write_offsets(f, plan: Plan) -> None:
    """Copy each packed sequence's ``cu_seqlens`` (and ``cu_seqlens_k``) beside its ``out``.

    The output's mask attributes (window, rope) come with the provenance attributes.
    """
    for seq in plan.sequences:
        if seq.cu_seqlens is None and seq.cu_seqlens_k is None:
            continue  # (no group object built for a sequence without offsets)
        node = f.require_group(seq.group) if seq.group else f
        for name in ("cu_seqlens", "cu_seqlens_k"):
            cu = getattr(seq, name)
            if cu is not None:
                node.create_dataset(name, data=np.asarray(cu, dtype=np.int64), track_times=False)


def _group(f, h5py, path: str):
    """The ``GroupID`` of group ``path`` of ``f`` (created with its parents), or the root's."""
    if not path:
        return f.id
    name = path.encode()
    if f.id.links.exists(name) if "/" not in path else path in f:
        return h5py.h5g.open(f.id, name)
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    return h5py.h5g.create(f.id, name, lcpl=lcpl)


def _sources(ctx, i: int, where: dict, starts: dict):
    """Yield (relative part file, rows in it, first row, runs) for each rank of sequence ``i``.

    ``where[i]`` is the batch holding ``i`` (its members, in order): the part
    is the first member's, ``i``'s rows start after the earlier members'
    (``starts`` caches each batch's row offsets per rank).
    """
    members = where[i]
    size = ctx.nranks.get(members[0], ctx.size)
    if members not in starts:
        seqs = [ctx.plan.sequences[j] for j in members]
        per = [counts(s.length, size, ctx.layout, cu_seqlens=s.cu_seqlens) for s in seqs]
        starts[members] = np.concatenate([np.zeros((1, size), np.int64),
                                          np.cumsum(per, axis=0)])  # fmt: skip
    rows, k = starts[members], members.index(i)
    seq = ctx.plan.sequences[i]
    rel = vds_name(os.path.basename(ctx.parts))
    for r in range(size):
        pos = positions(seq.length, r, size, ctx.layout, cu_seqlens=seq.cu_seqlens)
        yield (f"{rel}/{part_name(members[0], r)}", int(rows[-1, r]), int(rows[k, r]),
               local_runs(pos))  # fmt: skip


def write_vds(
    path: str,
    plan,
    attrs: dict,
    parts: str,
    size: int,
    layout: str,
    where: dict,
    nranks: Optional[dict] = None,
    publish: bool = True,
) -> Optional[str]:
    """Write the virtual-dataset file ``path`` stitching the part files in ``parts``.

    The mapping needs only the plan and which batch holds each sequence, not the
    parts themselves: the file can be built before they are written.

    Parameters
    ----------
    plan : ringmpi.job.schema.Plan
    attrs : dict
        Root attributes (the run's provenance).
    parts : str
        The parts folder; ``size`` ranks per ring wrote it, tokens laid out by ``layout``.
    where : dict
        Sequence index -> the members of the batch whose part files hold it.
    nranks : dict, optional
        First member of a batch -> ranks of the ring that wrote it (default ``size``:
        ``--ring-size auto`` gives each sequence its own).
    publish : bool
        False: leave the file under its exclusive temporary name, not fsync'ed, and
        return that name (:func:`publish_vds` renames it into place later).
    """
    import h5py

    ctx = _Parts(plan, attrs, parts, size, layout, nranks or {})
    h, d = plan.heads, plan.head_dim
    dt = np.dtype(plan.dtype)
    lt = np.dtype(np.float64 if dt == np.float64 else np.float32)
    # a new file (never a planted name); built ahead, it waits in the parts folder
    fd, tmp = exclusive_temp(path if publish else os.path.join(parts, INDEX))
    os.close(fd)
    try:
        _fill_vds(ctx, tmp, h5py, plan, h, d, dt, lt, where)
        if not publish:
            return tmp
        publish_vds(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return None


def publish_vds(tmp: str, path: str) -> None:
    """fsync the built file ``tmp``, rename it to ``path``, fsync the folder."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def _fill_vds(ctx, tmp, h5py, plan, h, d, dt, lt, where: dict) -> None:
    missing = [s.name for i, s in enumerate(plan.sequences) if i not in where]
    if missing:  # cannot happen when every ring finished: never stitch a hole
        raise ValueError(f"no part holds sequence {missing[0]}")
    starts: dict = {}
    cache: dict = {}  # dtype -> (template property list, HDF5 type), for virtual_dataset
    batch = plan.structure == "batch"
    with h5py.File(tmp, "w", locking="best-effort") as f:
        for key, val in ctx.attrs.items():
            f.attrs[key] = val
        f.attrs["structure"] = plan.structure
        maps_o, maps_l = [], []
        for i, seq in enumerate(plan.sequences):
            bi = (i,) if batch else ()
            one = (1,) if batch else ()
            for fname, n, row0, rns in _sources(ctx, i, where, starts):
                for g0, cnt, step, o in rns:
                    # out (S, H, D) <- rows [o, o + cnt) of the part's out (n, H, D)
                    maps_o.append((bi + (g0, 0, 0), one + (cnt, 1, 1), one + (step, 1, 1),
                                   one + (1, h, d), fname, (n, h, d), (row0 + o, 0, 0),
                                   (cnt, h, d)))  # fmt: skip
                    maps_l.append((bi + (0, g0), one + (1, cnt), one + (1, step),
                                   one + (h, 1), fname, (h, n), (0, row0 + o),
                                   (h, cnt)))  # fmt: skip
            if not batch:
                node = _group(f, h5py, seq.group)
                o = virtual_dataset(node, "out", (seq.length, h, d), dt, maps_o, cache)
                ls = virtual_dataset(node, "lse", (h, seq.length), lt, maps_l, cache)
                label_ids(o, ls, batch=False)
                maps_o, maps_l = [], []
        if batch:
            b, s = len(plan.sequences), plan.sequences[0].length
            o = virtual_dataset(f, "out", (b, s, h, d), dt, maps_o)
            ls = virtual_dataset(f, "lse", (b, h, s), lt, maps_l)
            label_ids(o, ls, batch=True)
        write_offsets(f, plan)
