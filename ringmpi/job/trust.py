"""What an input file may make the job do: read itself, and only what was written.

The contents of an input are not trusted (see docs/security.md). Before a
dataset is used the scan checks that

* no link on the way is an HDF5 external link (or a user-defined link): the file
  would make the job open another file (:func:`check_links`; the ranks of a job
  share the walk, :func:`walk_links`, and a file walked and unchanged since is not
  walked again, :func:`walked`);
* the dataset keeps its data in the file: no external raw storage, no virtual
  dataset unless ``RINGMPI_ALLOW_VDS=1`` (:func:`check_layout`);
* its storage is allocated in full: a dataset created but never (or only partly)
  written would be computed on fill values (:func:`check_written`);
* it is not stored in so many tiny chunks that reading it costs more memory and
  time than the data (``MAX_CHUNKS``).

HDF5 filter plugins are never loaded (:func:`disable_plugins`): the built-in
filters (deflate, shuffle, fletcher32, szip where built, LZF from h5py) are all the
job needs, and an unknown filter id must not make HDF5 dlopen what lies on
``HDF5_PLUGIN_PATH``.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

import numpy as np

__all__ = [
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
]

MAX_CHUNKS = 1_000_000  # chunks per dataset
# many chunks this small cost HDF5 far more memory and time than their data
TINY_CHUNK_BYTES, TINY_CHUNKS = 1024, 65536
MAX_LINKS = 1_000_000  # links walked per file
VDS_ENV = "RINGMPI_ALLOW_VDS"
_plugins_off = False


class _Refused(Exception):
    """Internal: carries the one-line reason to the caller, which names the file."""


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

    ``below``: the ranks of a job share the walk (:func:`ringmpi.job.inputs.scan_file`):
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
            fname, path = (x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                           for x in target)  # fmt: skip
            why.append(f"'{where}' is an external link to {fname}:{path}: "
                       "inputs are read only from themselves")  # fmt: skip
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
    process, or by a job's ranks together, :func:`ringmpi.job.schema.make_plan`):
    :func:`ringmpi.job.inputs.open_input` need not walk them again while it is unchanged."""
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
