"""The output's folder on a shared machine: who owns it, who writes it, what names mean.

``OUT.h5.parts/`` is made by the job (or must be a real directory of this user that
nobody else can write); one job at a time holds its lock; side files (the summary
JSON, a packed copy) may not land on an input or inside the folder.
"""

from __future__ import annotations

import glob
import io
import os
import stat
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...layout import counts, local_runs, positions
from ...runtime.files import check_owned, exclusive_temp, fsync_path, replace_with
from ..plan import InputError, Plan, layout_mask, sliced, value_width

__all__ = [
    "vds_name",
    "open_parts_dir",
    "lock_output",
    "unlock_output",
    "valid_marker",
    "marker_members",
    "crc32_of",
    "check_side_file",
    "write_h5",
    "write_arrays",
    "INDEX",
    "write_vds",
    "publish_vds",
    "virtual_dataset",
    "label_dims",
    "write_offsets",
    "part_name",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_held: dict = {}  # (st_dev, st_ino) of a parts folder -> lock fd held by this process


def vds_name(name: str) -> str:
    """``name`` as a virtual-dataset source file name: HDF5 expands ``%b`` etc., ``%%`` is ``%``."""
    return name.replace("%", "%%")


def open_parts_dir(parts: str, create: bool) -> int:
    """Open (with ``create``, make) an output's parts folder; its descriptor.

    The folder must be a real directory (not a symlink) of this user that group and
    others cannot write: files in it are then only ever this user's.

    Raises
    ------
    InputError
        A symlink, another user's folder, or one others can write.
    """
    if create:
        try:
            os.mkdir(parts, 0o755)
        except FileExistsError:
            pass
    try:
        fd = os.open(parts, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
    except OSError as e:
        if os.path.islink(parts):
            raise InputError(f"{parts}: is a symlink; the job makes its parts folder itself") from e
        raise
    try:
        check_owned(os.fstat(fd), parts, "remove it or use another -o")
    except PermissionError as e:
        os.close(fd)
        raise InputError(str(e)) from None
    return fd


def lock_output(parts: str, fd: int) -> None:
    """Hold an exclusive lock on the parts folder ``fd`` for the life of the process.

    A second job on the same ``-o`` (even with ``--overwrite``) stops with one line
    instead of deleting the first one's parts. File systems without locks run unlocked.
    """
    import fcntl

    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) in _held:
        return
    lock = os.dup(fd)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise InputError(
            f"{parts}: another job is writing this output (it holds the folder's lock); "
            "wait for it or use another -o"
        ) from None
    except OSError:  # no locks on this file system
        os.close(lock)
        return
    _held[(st.st_dev, st.st_ino)] = lock


def unlock_output(parts: str) -> None:
    """Release the lock :func:`lock_output` took on ``parts`` (the job is complete)."""
    import fcntl

    try:
        st = os.stat(parts)
    except OSError:
        return
    lock = _held.pop((st.st_dev, st.st_ino), None)
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)


def valid_marker(marker, name: str, nranks: int) -> bool:
    """Is ``marker`` a part-file marker of sequence ``name`` over ``nranks`` ranks?"""
    if not isinstance(marker, dict) or marker.get("sequence") != name:
        return False
    parts = marker.get("parts")
    return (
        isinstance(parts, list)
        and len(parts) == nranks
        and all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int and x >= 0 for x in p)
            for p in parts
        )
    )


def check_side_file(path: str, what: str, output: str, inputs=()) -> None:
    """Refuse a side file (``what``: e.g. ``--summary-json``) that would clobber the run's data.

    Parameters
    ----------
    path : str
        The side file.
    output : str
        The run's ``-o`` (the side file may not be it, nor lie in its parts folder).
    inputs : sequence of str
        Input files or glob patterns (the side file may not be one of them).
    """
    full = os.path.abspath(path)
    out = os.path.abspath(output)
    parts = out + ".parts"
    if full == out or (
        os.path.exists(full) and os.path.exists(out) and os.path.samefile(full, out)
    ):
        raise InputError(f"{path}: {what} would overwrite the output {output}")
    d = os.path.dirname(full)
    if d == parts or (os.path.isdir(parts) and os.path.samefile(d, parts)):
        raise InputError(f"{path}: {what} would write into the output's parts folder {parts}")
    for pattern in inputs:
        for p in glob.glob(pattern) or [pattern]:
            if os.path.abspath(p) == full or (
                os.path.exists(p) and os.path.exists(full) and os.path.samefile(p, full)
            ):
                raise InputError(f"{path}: {what} would overwrite input {p}")


def crc32_of(path: str) -> Optional[tuple]:
    """(size, CRC32) of regular file ``path`` (a symlink is not followed), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    crc, size = 0, 0
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        while True:
            b = fh.read(1 << 22)
            if not b:
                return size, crc
            size += len(b)
            crc = zlib.crc32(b, crc)


def marker_members(marker: dict, i: int, names: list) -> Optional[tuple]:
    """The sequences the marker ``s<i>.done`` covers (its batch), or None if they do not add up.

    A batch's members are increasing plan indices starting at ``i``, named as in
    the plan (``names``: every sequence's name); a marker without ``members``
    covers ``i`` alone.
    """
    if "members" not in marker:
        return (i,)
    members, listed = marker.get("members"), marker.get("names")
    if not (isinstance(members, list) and isinstance(listed, list)) or len(members) < 2:
        return None
    if len(listed) != len(members) or not all(type(j) is int for j in members):
        return None
    if members[0] != i or any(b <= a for a, b in zip(members, members[1:])):
        return None
    if members[-1] >= len(names) or [names[j] for j in members] != listed:
        return None
    return tuple(members)


# ----------------------------------------------------------------------
# One part file written from the arrays themselves: HDF5 lays it out, Python writes it.
#
# A part holds a few large contiguous datasets (``out``, ``lse``, ``pos``) and a
# few attributes. Building it in HDF5's in-memory file and copying out the image
# (:func:`write_h5`) passes over the output twice more than the disk needs, with
# a fresh page fault per 4 KiB each time: about 0.13 s per 65k-token batch here,
# a second per rank on the 2,000-sequence set. :func:`write_arrays` instead has
# HDF5 build only the file's metadata: each dataset is created with its storage
# allocated at once and never filled (HDF5 writes none of its bytes), HDF5's own
# writes go to :class:`_Metadata` (kilobytes, in memory), and the file is the
# metadata blocks and the arrays' bytes written in address order, straight from
# the arrays (tests/job/output/test_layout.py reads every array and attribute back).
#
# Every byte reaches the disk through Python (:func:`ringmpi.runtime.files.replace_with`,
# by ``O_DIRECT`` where the file system takes it: no page-cache copy,
# :mod:`ringmpi.runtime.direct_io`):
# a full disk raises a plain OSError and nothing is left under the final name.
# HDF5 1.10 (Debian 12's h5py 3.7) leaves a file whose close failed half torn
# down, and the next reference drop segfaults the rank: HDF5 itself never
# touches the disk here.


def write_h5(path: str, fill, sync: bool = True) -> tuple:
    """Build an HDF5 file in memory with ``fill(f)``, write its bytes to ``path`` (fsync'ed
    unless ``sync`` is False): (size, CRC32) of the bytes written.

    The general path (compressed parts: chunked datasets whose bytes only HDF5 knows).
    """
    import h5py

    with h5py.File(path, "w", driver="core", backing_store=False) as f:
        fill(f)
        f.flush()
        image = f.id.get_file_image()
    crc = replace_with(path, image, sync=sync, direct=True)
    return len(image), crc


def write_arrays(path: str, arrays: dict, attrs: dict, sync: bool = True) -> tuple:
    """Write an HDF5 file of contiguous datasets ``arrays`` {name: array} and root ``attrs``.

    Returns (size, CRC32) of the file written (what ``crc32_of`` reads back).
    """
    import h5py
    from h5py import h5d, h5p, h5s, h5t

    arrays = {n: np.ascontiguousarray(a) for n, a in arrays.items()}
    meta = _Metadata()
    ids = {}
    with h5py.File(meta, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for name, a in arrays.items():
            dcpl = h5p.create(h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)  # the addresses are known now
            dcpl.set_fill_time(h5d.FILL_TIME_NEVER)  # and HDF5 writes no data byte
            dcpl.set_obj_track_times(False)  # reruns: the same bytes
            tid = h5t.py_create(a.dtype, logical=1)
            ids[name] = h5d.create(f.id, name.encode(), tid, h5s.create_simple(a.shape), dcpl=dcpl)
        f.flush()
        data = []
        for name, a in arrays.items():
            off = ids[name].get_offset()
            if a.nbytes:
                if off is None or ids[name].get_storage_size() != a.nbytes:
                    raise RuntimeError(f"HDF5 allocated no contiguous storage for '{name}'")
                data.append((int(off), memoryview(a).cast("B")))
        del ids
    pieces = _layout(meta.blocks(), data, meta.eof)
    crc = replace_with(path, pieces, sync=sync, direct=True)
    return sum(len(p) for p in pieces), crc


def _layout(blocks: list, data: list, eof: int) -> list:
    """The file's bytes in address order: metadata ``blocks`` and ``data`` [(offset, bytes)],
    zeros in any gap, up to ``eof`` at least. Overlaps mean HDF5 wrote where the data goes."""
    pieces, at = [], 0
    for off, b in sorted(blocks + data, key=lambda x: x[0]):
        if off < at:
            raise RuntimeError("HDF5 metadata overlaps a dataset's storage")
        if off > at:
            pieces.append(bytes(off - at))
        pieces.append(b)
        at = off + len(b)
    if eof > at:
        pieces.append(bytes(eof - at))
    return pieces


class _Metadata(io.RawIOBase):
    """The file object HDF5 writes its metadata to (h5py's file-object driver), kept sparse:
    the blocks it wrote, not the gigabytes of dataset storage between them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list = []  # (offset, bytes) in the order HDF5 wrote them
        self.pos = self.eof = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.eof)[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        b = bytes(memoryview(b).cast("B"))
        self.writes.append((self.pos, b))
        self.pos += len(b)
        self.eof = max(self.eof, self.pos)
        return len(b)

    def readinto(self, b) -> int:
        """What HDF5 reads back: its own writes (later over earlier), zeros elsewhere."""
        out = memoryview(b).cast("B")
        a, n = self.pos, len(out)
        out[:] = bytes(n)
        for off, w in self.writes:
            lo, hi = max(a, off), min(a + n, off + len(w))
            if lo < hi:
                out[lo - a : hi - a] = w[lo - off : hi - off]
        self.pos += n
        return n

    def truncate(self, size=None) -> int:
        self.eof = self.pos if size is None else int(size)
        return self.eof

    def blocks(self) -> list:
        """The written bytes as disjoint (offset, bytes) blocks, a later write over an earlier."""
        spans: list = []
        for off, w in sorted(self.writes, key=lambda x: x[0]):
            if spans and off <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], off + len(w))
            else:
                spans.append([off, off + len(w)])
        out = []
        for lo, hi in spans:
            buf = bytearray(hi - lo)
            for off, w in self.writes:  # in write order: the last write of a byte wins
                if lo <= off < hi:
                    buf[off - lo : off - lo + len(w)] = w
            out.append((lo, bytes(buf)))
        return out


# ----------------------------------------------------------------------
# The virtual-dataset file of the part-file output: every sequence in global token order.
#
# ``OUT.h5`` holds, per sequence, virtual datasets ``out`` (S, H, D) and ``lse``
# (H, S) mapping each run of a rank's tokens to its rows in the part file of the
# batch holding the sequence (:mod:`ringmpi.job.output.parts`); NaN is the fill value,
# so a copy without its parts reads NaN, never zeros. Rank 0 writes it once,
# in one pass over the sequences, with the HDF5 mapping calls directly.


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
    """Copy each packed sequence's ``cu_seqlens`` (and ``cu_seqlens_k``) beside its ``out``,
    and each mask of slices as an int64 (n, 5) ``slices`` (sorted, duplicates gone) whose
    attribute ``kinds`` names the codes of its last column.

    The output's mask attributes (window, rope) come with the provenance attributes.
    """
    from ...slices import KIND_CODES

    for seq in plan.sequences:
        if seq.cu_seqlens is None and seq.cu_seqlens_k is None and sliced(seq) is None:
            continue  # (no group object built for a sequence without offsets)
        node = f.require_group(seq.group) if seq.group else f
        if sliced(seq) is not None:
            ds = node.create_dataset("slices", data=seq.slices.table(), track_times=False)
            ds.attrs["kinds"] = KIND_CODES
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
        per = [
            counts(
                s.length, size, ctx.layout, cu_seqlens=s.cu_seqlens, mask=layout_mask(s, ctx.layout)
            )
            for s in seqs
        ]
        starts[members] = np.concatenate([np.zeros((1, size), np.int64), np.cumsum(per, axis=0)])
    rows, k = starts[members], members.index(i)
    seq = ctx.plan.sequences[i]
    rel = vds_name(os.path.basename(ctx.parts))
    mask = layout_mask(seq, ctx.layout)
    for r in range(size):
        pos = positions(seq.length, r, size, ctx.layout, cu_seqlens=seq.cu_seqlens, mask=mask)
        yield (
            f"{rel}/{part_name(members[0], r)}",
            int(rows[-1, r]),
            int(rows[k, r]),
            local_runs(pos),
        )


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
    plan : ringmpi.job.plan.Plan
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
    h, d = plan.heads, value_width(plan)  # out has the value width
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
                    maps_o.append(
                        (
                            bi + (g0, 0, 0),
                            one + (cnt, 1, 1),
                            one + (step, 1, 1),
                            one + (1, h, d),
                            fname,
                            (n, h, d),
                            (row0 + o, 0, 0),
                            (cnt, h, d),
                        )
                    )
                    maps_l.append(
                        (
                            bi + (0, g0),
                            one + (1, cnt),
                            one + (1, step),
                            one + (h, 1),
                            fname,
                            (h, n),
                            (0, row0 + o),
                            (h, cnt),
                        )
                    )
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
