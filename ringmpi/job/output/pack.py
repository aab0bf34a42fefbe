"""``ringmpi pack``: one self-contained HDF5 file from an output and its parts folder.

``ringmpi run -o OUT.h5`` writes ``OUT.h5`` as virtual datasets over the part
files in ``OUT.h5.parts/``; copied alone it reads NaN (the fill value). Packing
copies every ``out`` and ``lse`` into ordinary (optionally compressed) datasets
of a new file, with the same groups, attributes and dimension labels. The copy
streams slabs of at most ``SLAB_BYTES``: no sequence is ever held in memory.
The new file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np

from ...runtime import interrupt
from ...runtime.files import exclusive_temp, fsync_path
from ..plan import InputError
from .layout import check_side_file
from .parts import COMPRESSION

__all__ = ["pack", "SLAB_BYTES"]

SLAB_BYTES = 64 << 20  # bytes copied per read/write


def _datasets(f) -> list:
    """Paths of the ``out``/``lse`` datasets of an output file, in order."""
    import h5py

    found = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and name.rsplit("/", 1)[-1] in ("out", "lse"):
            found.append(name)

    f.visititems(visit)
    return sorted(found)


def _offsets(f) -> list:
    """Paths of the ``cu_seqlens``/``cu_seqlens_k`` datasets (packed sequences) and of the
    ``slices`` datasets (masks of slices), in order."""
    found: list = []
    f.visititems(
        lambda name, obj: (
            found.append(name)
            if name.rsplit("/", 1)[-1] in ("cu_seqlens", "cu_seqlens_k", "slices")
            else None
        )
    )
    return found


def _missing_sources(path: str, f, names: list) -> list:
    """Part files the virtual datasets map that do not exist (relative to the output)."""
    base = os.path.dirname(os.path.abspath(path))
    missing = []
    for n in names:
        ds = f[n]
        if not ds.is_virtual:
            continue
        for vs in ds.virtual_sources():
            p = vs.file_name
            full = p if os.path.isabs(p) else os.path.join(base, p)
            if p != "." and not os.path.exists(full) and full not in missing:
                missing.append(full)
    return missing


def _token_axis(name: str, ds) -> int:
    """Axis of the tokens: out (..., S, H, D) -> -3, lse (..., H, S) -> -1."""
    return ds.ndim - 3 if name.endswith("out") else ds.ndim - 1


def pack(
    output: str,
    target: str,
    compress: Optional[str] = None,
    overwrite: bool = False,
    on_progress: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """Copy ``output`` (virtual datasets over parts) into the self-contained file ``target``.

    Parameters
    ----------
    output : str
        A file written by ``ringmpi run``.
    target : str
        The file to write (refused if it exists, unless ``overwrite``).
    compress : {None, "gzip", "lzf"}
        Compression of the datasets in ``target`` (chunked, shuffle filter).
    on_progress : callable, optional
        Called as on_progress(bytes_done, bytes_total) after each slab.

    Returns
    -------
    dict
        {"datasets": n, "bytes": logical bytes copied, "file_bytes": size of target}.
    """
    import h5py

    if compress not in (None,) + COMPRESSION:
        raise InputError(f"--compress must be one of {', '.join(COMPRESSION)}")
    if not os.path.isfile(output):
        raise InputError(f"{output}: no such file")
    if os.path.lexists(target) and not overwrite:
        raise InputError(f"{target}: exists; use --overwrite to replace it")
    if os.path.exists(target) and os.path.samefile(output, target):
        raise InputError(f"{target}: is the output itself")
    check_side_file(target, "pack -o", output)
    try:
        src = h5py.File(output, "r", locking=False)
    except OSError as e:
        raise InputError(f"{output}: cannot open as HDF5 ({e})") from e
    tmp = None
    try:
        names = _datasets(src)
        if not names or "format" not in src.attrs:
            raise InputError(f"{output}: not a ringmpi output file (no out/lse datasets)")
        missing = _missing_sources(output, src, names)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise InputError(
                f"{output}: part file {missing[0]} is missing{more}: the parts folder must "
                "stay beside the output until it is packed"
            )
        total = sum(src[n].size * src[n].dtype.itemsize for n in names)
        done = 0
        fd, tmp = exclusive_temp(target)  # a new file in the target's folder, never a planted name
        os.close(fd)
        with h5py.File(tmp, "w", locking="best-effort") as dst:
            for k, v in src.attrs.items():
                dst.attrs[k] = v
            dst.attrs["packed_from"] = os.path.abspath(output)
            dst.attrs["packed_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for n in names:
                ds = src[n]
                axis = _token_axis(n, ds)
                row = max(1, ds.size // max(1, ds.shape[axis])) * ds.dtype.itemsize
                step = int(max(1, min(ds.shape[axis], SLAB_BYTES // row)))
                opts: dict = {"fillvalue": ds.dtype.type(np.nan)}
                if compress and ds.size:
                    # ~1 MiB chunks: whole heads, a run of tokens, one sequence of a batch
                    core = ds.ndim - (3 if n.endswith("out") else 2)
                    chunk = [1 if a < core else s for a, s in enumerate(ds.shape)]
                    per_token = ds.dtype.itemsize * int(np.prod(chunk)) // max(1, chunk[axis])
                    chunk[axis] = int(max(1, min(ds.shape[axis], (1 << 20) // per_token)))
                    opts.update(chunks=tuple(chunk), shuffle=True, compression=compress)
                out = dst.create_dataset(n, shape=ds.shape, dtype=ds.dtype, **opts)
                for a in range(0, ds.shape[axis], step):
                    interrupt.check()
                    sel = tuple(
                        slice(a, a + step) if d == axis else slice(None) for d in range(ds.ndim)
                    )
                    block = ds[sel]
                    out[sel] = block
                    done += block.nbytes
                    if on_progress is not None:
                        on_progress(done, total)
                for d in range(ds.ndim):
                    if ds.dims[d].label:
                        out.dims[d].label = ds.dims[d].label
            for n in _offsets(src):  # packed offsets and masks of slices, beside their out
                got = dst.create_dataset(n, data=src[n][()])
                for key, val in src[n].attrs.items():
                    got.attrs[key] = val
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(os.path.dirname(os.path.abspath(target)))
    except OSError as e:
        raise InputError(f"{target}: cannot write ({e})") from e
    finally:
        src.close()
        if tmp is not None and os.path.lexists(tmp):
            os.remove(tmp)
    return {"datasets": len(names), "bytes": total, "file_bytes": os.path.getsize(target)}
