"""One input file: open it safely and check each dataset before anything is read.

The stage below :mod:`ringmpi.job.input.scan`: :func:`open_input` refuses what is not a
regular HDF5 file or links elsewhere (:mod:`ringmpi.job.input.files`), :func:`dataset`
checks a q/k/v/x dataset's dtype, rank and storage, :func:`read_offsets` reads a
``cu_seqlens`` in bounded slabs, and :func:`scan_file` collects the metadata of one
file for :func:`ringmpi.job.input.scan.scan`. Every problem is an :class:`InputError`
"PATH: PROBLEM" (one line).
"""

from __future__ import annotations

import math
import os
import stat
from typing import Optional

import numpy as np

from ...runtime import interrupt
from ...slices import KIND_CODES
from ..plan import InputError, fail

__all__ = [
    "open_input",
    "check_storage",
    "trusted",
    "dataset",
    "read_offsets",
    "check_offsets",
    "read_slices",
    "check_slices",
    "found",
    "no_data",
    "guarded",
    "scan_file",
    "FLOAT_DTYPES",
    "MAX_DIM",
    "MAX_PACKED",
    "MAX_SLICES",
    "MAX_SLICE_ROWS",
    "MAX_CHUNKS",
    "MAX_LINKS",
    "VDS_ENV",
    "disable_plugins",
    "check_regular",
    "check_links",
    "walk_links",
    "identity",
    "links_known",
    "walked",
    "check_layout",
    "check_written",
    "raw_offset",
]

FLOAT_DTYPES = ("float16", "float32", "float64")
# Any declared dimension above this is treated as corrupt rather than merely large.
MAX_DIM = 1 << 40
MAX_PACKED = 1 << 22  # packed sequences per group: cu_seqlens is read whole on rank 0
# slices per sequence (issue 41): a (n, 5) table read whole by every rank; each slice costs
# the mask's layers O(the rows it covers), so the cap bounds the read and the layers alike
MAX_SLICES = 1 << 16
# query rows the slices of a sequence cover, summed over its slices: the mask's normal form
# holds one entry per (slice, covered row) before it merges them (Slices.row_intervals)
MAX_SLICE_ROWS = 1 << 25


def open_input(path: str, walk: bool = True):
    """Open an HDF5 file for reading (no locking); InputError naming the file if it cannot.

    Its links are walked first unless they were (:func:`ringmpi.job.input.files.walked`) and the
    file is unchanged; ``walk=False``: the caller walks them before opening anything.
    """
    import h5py

    if not os.path.exists(path):
        fail(path, "no such file")
    if os.path.isdir(path):
        fail(path, "is a directory, not an HDF5 file")
    why = check_regular(path)
    if why:
        fail(path, why)
    disable_plugins()
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        reason = str(e).split("(", 1)[-1].rstrip(")") if "(" in str(e) else str(e)
        fail(path, f"cannot open as HDF5 (truncated or not an HDF5 file: {reason})")
    if not walk:
        return f
    seen = None
    try:
        seen = identity(f)
        why = "" if walked(seen) else check_links(f)
    except Exception as e:  # noqa: BLE001 - damaged link metadata
        first = str(e).splitlines()[0] if str(e) else ""
        why = f"unreadable HDF5 links ({type(e).__name__}: {first})"
    if why:
        f.close()
        fail(path, why)
    links_known(seen)
    return f


def trusted(path: str, ds) -> None:
    """Refuse a dataset that reads another file or was not written in full (see trust)."""
    try:
        why = check_layout(ds) or check_written(ds)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        why = f"dataset '{ds.name}' has unreadable storage metadata ({e})"
    if why:
        fail(path, why)


def check_storage(path: str, ds, size: int) -> None:
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


def dataset(path: str, f, name: str, ndim: int, fsize: int):
    """The float dataset ``name`` of group ``f``, checked (InputError naming ``path`` if not).

    Parameters
    ----------
    path : str
        The file, for the message.
    f : h5py.Group
    name : str
    ndim : int
        Dimensions the dataset must have.
    fsize : int
        Size of the file in bytes (storage past it is refused).
    """
    import h5py

    try:
        obj = f.get(name)
    except (KeyError, OSError, RuntimeError) as e:
        fail(path, f"cannot open dataset '{name}' ({e})")
    if obj is None:
        fail(path, f"missing dataset '{name}'")
    if not isinstance(obj, h5py.Dataset):
        fail(path, f"'{name}' is not a dataset")
    return _checked(path, name, obj, obj.dtype.name, ndim, fsize)


def _checked(path: str, name: str, ds, dtype_name: Optional[str], ndim: int, fsize: int):
    """``ds`` (an h5py.Dataset or a LiteDataset) after the float/rank/storage/trust checks."""
    dtype_name = ds.dtype_name if dtype_name is None else dtype_name
    if ds.dtype.kind != "f" or dtype_name not in FLOAT_DTYPES:
        fail(path, f"dataset '{name}' has dtype {ds.dtype}, expected float16, float32 or float64")
    if ds.ndim != ndim:
        fail(path, f"dataset '{name}' has shape {ds.shape}, expected {ndim} dimensions")
    check_storage(path, ds, fsize)
    trusted(path, ds)
    return ds


class LiteDataset:
    """What the checks read of a dataset (name, shape, dtype, chunks, ...), from its low-level id.

    The scan of a file of thousands of groups spent most of its time building
    h5py's high-level objects (groups, datasets, their file objects); this holds
    the same facts from one ``H5Dopen`` and its creation property list, and
    :func:`check_storage` / :func:`trusted` accept it like an ``h5py.Dataset``.
    """

    __slots__ = (
        "id",
        "name",
        "shape",
        "ndim",
        "dtype",
        "dtype_name",
        "chunks",
        "size",
        "file",
        "dcpl",
    )

    def __init__(self, dsid, name: str, filename: str) -> None:
        from types import SimpleNamespace

        from h5py import h5d

        self.id, self.name = dsid, name
        self.shape = tuple(int(n) for n in dsid.shape)
        self.ndim = len(self.shape)
        self.dtype = dsid.dtype
        self.dtype_name = _dtype_name(self.dtype)
        self.dcpl = dsid.get_create_plist()  # read once, by the trust checks too
        self.chunks = self.dcpl.get_chunk() if self.dcpl.get_layout() == h5d.CHUNKED else None
        self.size = math.prod(self.shape)
        self.file = SimpleNamespace(filename=filename)


_NAMES: dict = {}


def _dtype_name(dt) -> str:
    """``dt.name``, cached (numpy computes it in Python: slow on thousands of datasets)."""
    name = _NAMES.get(dt)
    if name is None:
        name = _NAMES[dt] = dt.name
    return name


def lite_dataset(path: str, gid, group: str, name: str, ndim: int, fsize: int) -> LiteDataset:
    """:func:`dataset` on the low-level ``GroupID`` ``gid`` of group ``group`` (same checks)."""
    from h5py import h5d, h5o

    key = name.encode()
    full = f"/{group}/{name}" if group else f"/{name}"
    try:  # the usual case, a dataset: 12 us (h5o.open and the link test: 53 us)
        dsid = h5d.open(gid, key)
    except (KeyError, ValueError, OSError, RuntimeError, TypeError):
        dsid = None  # not there, not a dataset, unreadable: the general path says which
    if dsid is not None:
        return _checked(path, name, LiteDataset(dsid, full, path), None, ndim, fsize)
    try:
        obj = h5o.open(gid, key) if gid.links.exists(key) else None
    except KeyError:  # a dangling soft link: nothing there (as Group.get)
        obj = None
    except (OSError, RuntimeError) as e:
        fail(path, f"cannot open dataset '{name}' ({e})")
    if obj is None:
        fail(path, f"missing dataset '{name}'")
    if not isinstance(obj, h5d.DatasetID):
        fail(path, f"'{name}' is not a dataset")
    ds = LiteDataset(obj, full, path)
    return _checked(path, name, ds, ds.dtype_name, ndim, fsize)


def scan_file(path: str, structure_hint: Optional[str], part: Optional[tuple] = None) -> dict:
    """Metadata of one file: {"mode", "structure", "seqs": [(group, batch, shapes)], ...}.

    ``part=(r, n)``: n ranks share the scan and the link walk: each takes the root's
    entries ``r::n`` by name (one sequence: ``r == 0`` scans it), walks below them and
    scans its groups of data (``mode``: its first group's or None; the merge compares).
    """
    f = open_input(path, walk=part is None)
    try:
        fsize = os.path.getsize(path)
        links = 0
        if part is not None:  # the root's own links first: the lookups below follow them
            links = _walk(path, f, [])
        if "q" in f or "x" in f:
            top = "q" if "q" in f else "x"
            nd = f[top].ndim if hasattr(f[top], "ndim") else 0
            structure = "batch" if nd == (4 if top == "q" else 3) else "single"
            groups = [""]
        else:
            structure, groups = "groups", None
        if structure_hint and structure != structure_hint:
            problem = f"{structure} structure, first input is {structure_hint}"
            fail(path, f"shards do not line up: {problem}")
        if part is not None:
            r, n = part
            names = sorted(e.decode() for e in f.id.__iter__())[r::n]  # link names only
            links += _walk(path, f, names)
            groups = _data_groups(f, names) if groups is None else groups[: 1 if r == 0 else 0]
        elif groups is None:
            groups = _data_groups(f, sorted(e.decode() for e in f.id.__iter__()))
            if not groups:
                fail(path, no_data(f))
        mode = None
        if groups:
            mode = "qkv" if "q" in (f[groups[0]] if groups[0] else f) else "features"
        seqs = []
        for g in groups:
            interrupt.check()  # planning a file of many groups can take long: Ctrl-C acts
            seqs.append((g, _scan_group(path, f, g, mode, structure, fsize)))
        meta = {"mode": mode, "structure": structure, "seqs": seqs}
        if part is not None:
            meta.update(links=links, identity=identity(f))
        return meta
    finally:
        f.close()


def no_data(f) -> str:
    """The error of a file with no sequence: what it holds instead."""
    return f"no dataset 'q' (or features 'x') at the root or in any group; {found(f)}"


def _walk(path: str, f, below: list) -> int:
    """:func:`walk_links` below ``below``: the links walked, or InputError."""
    try:
        why, n = walk_links(f, below)
    except Exception as e:  # noqa: BLE001 - damaged link metadata
        first = str(e).splitlines()[0] if str(e) else ""
        why, n = f"unreadable HDF5 links ({type(e).__name__}: {first})", 0
    if why:
        fail(path, why)
    return n


def _data_groups(f, names: list) -> list:
    """Those of the root's entries ``names`` (in order) that are groups holding ``q`` or
    ``x`` (low-level: no Group objects)."""
    from h5py import h5g, h5o

    out = []
    for name in names:
        key = name.encode()
        if h5o.get_info(f.id, key).type != h5o.TYPE_GROUP:
            continue
        gid = h5g.open(f.id, key)
        if gid.links.exists(b"q") or gid.links.exists(b"x"):
            out.append(name)
    return out


def _scan_group(path: str, f, g: str, mode: str, structure: str, fsize: int) -> dict:
    """{dataset: (shape, dtype name)} of group ``g`` ("" the root), plus its offsets arrays."""
    from h5py import h5g

    extra = 1 if structure == "batch" else 0
    gid = h5g.open(f.id, g.encode()) if g else f.id  # low-level: no h5py objects
    names = ("q", "k", "v") if mode == "qkv" else ("x", "x_kv")
    if mode != "qkv" and gid.links.exists(b"q"):
        fail(path, f"group '{g}' holds q but others hold features x")
    shapes = {}
    for n in names:
        if n != "x_kv" or gid.links.exists(b"x_kv"):
            shapes[n] = lite_dataset(path, gid, g, n, (3 if mode == "qkv" else 2) + extra, fsize)
    info = {n: (d.shape, d.dtype_name) for n, d in shapes.items()}
    if not extra:  # where each dataset's bytes lie, for reads without HDF5 (Reader.gather)
        info["at"] = {n: raw_offset(d) for n, d in shapes.items()}
    if gid.links.exists(b"slices"):
        if structure == "batch":
            what = "'slices' (a mask per sequence) cannot be combined with a batch axis"
            fail(path, f"{what} (4-D q): store one group per sequence instead")
        info["slices"] = read_slices(path, f[g] if g else f, fsize)
    for name in ("cu_seqlens", "cu_seqlens_k"):
        if gid.links.exists(name.encode()):
            if structure == "batch":
                what = f"'{name}' (packed sequences) cannot be combined with a batch axis"
                fail(path, f"{what} (4-D q): store one group per sequence instead")
            # the tokens it splits: q (x), or k (x_kv) for the key offsets
            q_name, kv_name = ("q", "k") if mode == "qkv" else ("x", "x_kv")
            data = q_name if name == "cu_seqlens" else kv_name
            tokens = info.get(data, info[q_name])[0][extra]
            info[name] = read_offsets(path, f[g] if g else f, name, fsize, tokens)
    return info


def read_offsets(path: str, node, name: str, fsize: int, tokens: int) -> np.ndarray:
    """The packed-sequence offsets ``name`` of a group, checked to be a 1-D integer dataset.

    At most ``tokens + 1`` entries (``tokens``: the length of the data it splits) are
    accepted, checked before anything is read; they are read in slabs of 1 Mi.
    """
    import h5py

    ds = node[name]
    where = f"dataset '{ds.name}'"
    if not isinstance(ds, h5py.Dataset):
        fail(path, f"'{ds.name}' is not a dataset")
    if ds.dtype.kind not in "iu":
        fail(path, f"{where} has dtype {ds.dtype}, expected integer offsets [0, ..., S]")
    if ds.ndim != 1 or ds.shape[0] < 2:
        fail(path, f"{where} has shape {ds.shape}, expected (n+1,) offsets [0, ..., S]")
    if ds.shape[0] > MAX_PACKED + 1:
        fail(path, f"{where} declares {ds.shape[0] - 1} packed sequences (at most {MAX_PACKED})")
    if ds.shape[0] > tokens + 1:
        fail(path, f"{where} has {ds.shape[0]} offsets for {tokens} tokens (at most {tokens + 1})")
    check_storage(path, ds, fsize)
    trusted(path, ds)
    cu = np.empty(ds.shape[0], dtype=np.int64)
    step = 1 << 20
    for a in range(0, ds.shape[0], step):
        interrupt.check()
        part = ds[a : a + step]
        if part.size and (int(part.max()) > MAX_DIM or int(part.min()) < -MAX_DIM):
            fail(path, f"{where} holds an offset beyond +-{MAX_DIM}")
        cu[a : a + step] = part
    return cu


def check_offsets(path: str, where: str, name: str, cu: np.ndarray, n: int) -> None:
    """Refuse packed-sequence offsets that do not start at 0, decrease or do not end at ``n``."""
    if cu[0] != 0:
        fail(path, f"{where}'{name}' starts at {cu[0]}, expected 0")
    down = np.flatnonzero(cu[1:] < cu[:-1])  # neighbours compared: np.diff wraps near 2**63
    if len(down):
        i = int(down[0])
        fail(path, f"{where}'{name}' decreases at index {i + 1} ({cu[i]} -> {cu[i + 1]})")
    if cu[-1] != n:
        fail(path, f"{where}'{name}' ends at {cu[-1]} but the sequence has {n} tokens")


def read_slices(path: str, node, fsize: int) -> np.ndarray:
    """The mask of slices of a group: its ``slices`` dataset as an int64 (n, 5) table, checked.

    Rows are (q_start, q_end, k_start, k_end, kind code) over the sequence's global
    query and key positions, half-open, the kind a code of :data:`KIND_CODES`. The
    dataset must be integer, 2-D with 5 columns and at most :data:`MAX_SLICES` rows
    (checked before anything is read); every row needs 0 <= q_start <= q_end,
    0 <= k_start <= k_end and a known kind. The ends against the sequence's lengths
    are checked once the shards are summed (:func:`check_slices`).
    """
    import h5py

    ds = node["slices"]
    where = f"dataset '{ds.name}'"
    if not isinstance(ds, h5py.Dataset):
        fail(path, f"'{ds.name}' is not a dataset")
    form = "(n, 5) rows (q_start, q_end, k_start, k_end, kind)"
    if ds.dtype.kind not in "iu":
        fail(path, f"{where} has dtype {ds.dtype}, expected integers: {form}")
    if ds.ndim != 2 or ds.shape[1] != 5:
        fail(path, f"{where} has shape {ds.shape}, expected {form}")
    if ds.shape[0] > MAX_SLICES:
        fail(path, f"{where} declares {ds.shape[0]} slices (at most {MAX_SLICES})")
    check_storage(path, ds, fsize)
    trusted(path, ds)
    interrupt.check()
    raw = ds[()]
    if raw.size and (int(raw.max()) > MAX_DIM or int(raw.min()) < -MAX_DIM):
        fail(path, f"{where} holds a value beyond +-{MAX_DIM}")
    t = raw.astype(np.int64).reshape(-1, 5)
    q0, q1, k0, k1, kind = t.T
    for bad, why in (
        ((kind < 0) | (kind > 3), f"has kind code {{kind}}; the codes are {KIND_CODES}"),
        ((q0 < 0) | (k0 < 0), "starts before position 0"),
        (q1 < q0, "ends its query range before it starts (q_end < q_start)"),
        (k1 < k0, "ends its key range before it starts (k_end < k_start)"),
    ):
        at = np.flatnonzero(bad)
        if len(at):
            i = int(at[0])
            row = tuple(int(x) for x in t[i])
            fail(path, f"{where} row {i} {row} " + why.format(kind=row[4]))
    shown = (q1 > q0) & (k1 > k0)
    cover = int((q1 - q0)[shown].sum())
    if cover > MAX_SLICE_ROWS:
        fail(
            path,
            f"{where} covers {cover} query rows summed over its slices (at most "
            f"{MAX_SLICE_ROWS}): merge overlapping slices",
        )
    return t


def check_slices(path: str, where: str, t: np.ndarray, nq: int, nk: int) -> None:
    """Refuse a slices table (:func:`read_slices`) reaching beyond ``nq`` queries or ``nk`` keys."""
    at = np.flatnonzero((t[:, 1] > nq) | (t[:, 3] > nk))
    if len(at):
        i = int(at[0])
        row = tuple(int(x) for x in t[i])
        fail(
            path,
            f"{where}'slices' row {i} {row} reaches beyond the sequence's {nq} queries x {nk} keys",
        )


def found(f, limit: int = 8) -> str:
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


def guarded(path: str, fn, *args):
    """Call ``fn``; any unexpected failure on a damaged file becomes an InputError naming it."""
    try:
        return fn(*args)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt metadata raises all kinds of errors
        msg = str(e).splitlines()[0] if str(e) else ""
        fail(path, f"unreadable HDF5 metadata ({type(e).__name__}: {msg})")


# ----------------------------------------------------------------------
# What an input file may make the job do: read itself, and only what was written.
#
# The contents of an input are not trusted (see docs/security.md). Before a
# dataset is used the scan checks that
#
# * no link on the way is an HDF5 external link (or a user-defined link): the file
#   would make the job open another file (:func:`check_links`; the ranks of a job
#   share the walk, :func:`walk_links`, and a file walked and unchanged since is not
#   walked again, :func:`walked`);
# * the dataset keeps its data in the file: no external raw storage, no virtual
#   dataset unless ``RINGMPI_ALLOW_VDS=1`` (:func:`check_layout`);
# * its storage is allocated in full: a dataset created but never (or only partly)
#   written would be computed on fill values (:func:`check_written`);
# * it is not stored in so many tiny chunks that reading it costs more memory and
#   time than the data (``MAX_CHUNKS``).
#
# HDF5 filter plugins are never loaded (:func:`disable_plugins`): the built-in
# filters (deflate, shuffle, fletcher32, szip where built, LZF from h5py) are all the
# job needs, and an unknown filter id must not make HDF5 dlopen what lies on
# ``HDF5_PLUGIN_PATH``.


MAX_CHUNKS = 1_000_000  # chunks per dataset
# many chunks this small cost HDF5 far more memory and time than their data
TINY_CHUNK_BYTES, TINY_CHUNKS = 1024, 65536
MAX_LINKS = 1_000_000  # links walked per file
VDS_ENV = "RINGMPI_ALLOW_VDS"
_plugins_off = False


def disable_plugins() -> None:
    """Remove every HDF5 plugin search path of this process, so no filter plugin is loaded."""
    global _plugins_off
    if _plugins_off:
        return
    os.environ["HDF5_PLUGIN_PATH"] = os.devnull + "/none"  # for libraries not yet loaded
    try:
        from h5py import h5pl

        while h5pl.size():
            h5pl.remove(0)
    except (ImportError, AttributeError):  # HDF5 < 1.10.1: no plugin table to empty
        pass
    _plugins_off = True


def check_regular(path: str) -> str:
    """A reason to refuse ``path`` (a FIFO, a device: reading could block forever), or ''."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return ""
    return "is not a regular file (a FIFO, socket or device): refusing to read it"


def check_links(f) -> str:
    """Walk every link of the open file ``f`` without following one; a reason to refuse, or ''.

    :func:`walk_links` of the whole file.
    """
    return walk_links(f)[0]


def walk_links(f, below: Optional[list] = None) -> tuple:
    """Walk the links of the open file ``f`` without following one: (a reason to refuse or
    '', links walked).

    Hard and soft links stay inside the file; an external link or a user-defined
    link would make HDF5 open another file, so it is refused, named by its path.
    One H5Lvisit over the file (each group's links once, soft links not
    followed: their targets are walked from the root), no object opened.

    ``below``: the ranks of a job share the walk (:func:`ringmpi.job.input.files.scan_file`):
    the root's own links are checked (one level), then everything below the root
    entries named in ``below`` only; the ranks' lists together name every entry
    (``MAX_LINKS`` then applies to each share; the scan checks the sum).
    """
    from h5py import h5g, h5l, h5o

    seen, why = [0], []

    def visit(name: bytes, info, prefix: bytes = b""):
        seen[0] += 1
        if seen[0] > MAX_LINKS:
            why.append(f"holds more than {MAX_LINKS} links")
            return 1
        kind = info.type
        if kind == h5l.TYPE_HARD or kind == h5l.TYPE_SOFT:
            return None
        where = "/" + (prefix + name).decode("utf-8", "replace")
        if kind == h5l.TYPE_EXTERNAL:
            target = f.id.links.get_val(prefix + name)
            fname, path = (
                x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in target
            )
            why.append(
                f"'{where}' is an external link to {fname}:{path}: "
                "inputs are read only from themselves"
            )
        else:
            why.append(f"'{where}' is a user-defined link: inputs are read only from themselves")
        return 1

    if below is None:
        f.id.links.visit(visit, info=True)
    else:
        root = h5g.open(f.id, b"/")  # (kept: the proxy below does not keep it open)
        root.links.iterate(visit, info=True)  # the root's links, one level
        for name in below:
            if why:
                break
            key = name.encode()
            if h5o.get_info(f.id, key).type != h5o.TYPE_GROUP:  # (the root's links: checked)
                continue
            prefix, gid = key + b"/", h5g.open(f.id, key)
            gid.links.visit(lambda n, i, p=prefix: visit(n, i, p), info=True)
    return (why[0] if why else ""), seen[0]


def check_layout(ds) -> str:
    """A reason to refuse dataset ``ds`` (external raw storage; a VDS unless allowed), or ''."""
    from h5py import h5d

    dcpl = _dcpl(ds)
    if dcpl.get_external_count() > 0:
        name = dcpl.get_external(0)[0].decode(errors="replace")
        return (
            f"dataset '{ds.name}' keeps its data in external file {name}: "
            "inputs are read only from themselves"
        )
    from h5py import h5z

    for i in range(dcpl.get_nfilters()):
        fid = dcpl.get_filter(i)[0]
        if not h5z.filter_avail(fid):  # plugins are off: only the built-in filters count
            return (
                f"dataset '{ds.name}' needs HDF5 filter {fid}, which is not built in "
                "(filter plugins are never loaded)"
            )
    if dcpl.get_layout() == h5d.VIRTUAL:
        if os.environ.get(VDS_ENV, "0") == "1":
            return _vds_sources(ds, dcpl)
        return (
            f"dataset '{ds.name}' is a virtual dataset (its data lives in other files): "
            f"refused unless {VDS_ENV}=1"
        )
    return ""


def _vds_sources(ds, dcpl) -> str:
    """With VDS allowed: every source file must exist (missing ones read as fill values)."""
    base = os.path.dirname(os.path.abspath(ds.file.filename))
    for i in range(dcpl.get_virtual_count()):
        src = dcpl.get_virtual_filename(i)
        if src == ".":
            continue
        full = src if os.path.isabs(src) else os.path.join(base, src)
        if "%" not in src and not os.path.isfile(full):
            return f"virtual dataset '{ds.name}' maps missing source file {src}"
    return ""


def _dcpl(ds):
    """The dataset's creation property list (kept by a LiteDataset, else read)."""
    dcpl = getattr(ds, "dcpl", None)
    return ds.id.get_create_plist() if dcpl is None else dcpl


def check_written(ds) -> str:
    """A reason to refuse ``ds`` (storage short of its logical size, too many chunks), or ''."""
    from h5py import h5d

    if ds.size == 0:
        return ""
    layout = _dcpl(ds).get_layout()
    if layout == h5d.COMPACT or layout == h5d.VIRTUAL:
        return ""
    if ds.chunks is None:
        have, want = ds.id.get_storage_size(), ds.size * ds.dtype.itemsize
        if have < want:
            return (
                f"dataset '{ds.name}' has {have} of its {want} bytes written "
                "(created but not filled?): refusing to compute on fill values"
            )
        return ""
    grid = [int(-(-n // c)) for n, c in zip(ds.shape, ds.chunks)]
    want = int(np.prod(grid, dtype=object))
    chunk_bytes = int(np.prod(ds.chunks, dtype=object)) * ds.dtype.itemsize
    if want > MAX_CHUNKS or (want > TINY_CHUNKS and chunk_bytes < TINY_CHUNK_BYTES):
        return (
            f"dataset '{ds.name}' is stored in {want} chunks of {ds.chunks} ({chunk_bytes} "
            "bytes each): too many, too small; rechunk it (h5repack -l)"
        )
    have = ds.id.get_num_chunks()
    if have < want:
        return (
            f"dataset '{ds.name}' has {have} of its {want} chunks written "
            "(half written?): refusing to compute on fill values"
        )
    return ""


# files whose links this process walked: (device, inode) -> (size, mtime, ctime) then; the
# job opens each input twice (scan, then reader), and the walk reads all of a file's groups
_LINKS_OK: dict = {}


def links_known(identity: Optional[tuple]) -> None:
    """Every link of the file ``identity`` (:func:`identity`; None: nothing) was walked (by this
    process, or by a job's ranks together, :func:`ringmpi.job.input.scan.make_plan`):
    :func:`ringmpi.job.input.files.open_input` need not walk them again while it is unchanged."""
    if identity is not None:
        _LINKS_OK[identity[0]] = identity[1]


def walked(identity: Optional[tuple]) -> bool:
    """Were the links of the file ``identity`` walked, and is it unchanged since?"""
    return identity is not None and _LINKS_OK.get(identity[0]) == identity[1]


def identity(f) -> Optional[tuple]:
    """((device, inode), (size, mtime_ns, ctime_ns)) of the file h5py has open, or None."""
    try:
        st = os.fstat(f.id.get_vfd_handle()) if f.driver == "sec2" else None
    except (OSError, ValueError, TypeError):
        st = None
    if st is None:
        return None
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def raw_offset(ds) -> Optional[int]:
    """The file offset of dataset ``ds``'s bytes when they can be read as they lie: contiguous
    storage holding exactly its elements, in the machine's byte order; else None."""
    if ds.chunks is not None or not ds.dtype.isnative:
        return None
    try:
        off = ds.id.get_offset()
        if off is None or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize:
            return None
    except (OSError, RuntimeError, ValueError):
        return None
    return int(off)
