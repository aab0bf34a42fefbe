"""The output's folder on a shared machine: who owns it, who writes it, what names mean.

``OUT.h5.parts/`` is made by the job (or must be a real directory of this user that
nobody else can write); one job at a time holds its lock; side files (the summary
JSON, a packed copy) may not land on an input or inside the folder.
"""

from __future__ import annotations

import glob
import os
import stat
import zlib
from typing import Optional

from ..files import check_owned
from .schema import InputError

__all__ = [
    "vds_name",
    "open_parts_dir",
    "lock_output",
    "unlock_output",
    "valid_marker",
    "marker_members",
    "crc32_of",
    "check_side_file",
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
