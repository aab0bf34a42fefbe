"""Atomic file writes: a file under its final name is always complete.

Everything ringmpi writes goes to ``NAME.tmp`` first, is flushed to stable
storage, and is renamed into place; the directory is then flushed too, so the
rename survives a crash of the node.
"""

from __future__ import annotations

import json
import os

__all__ = ["fsync_path", "write_json"]


def fsync_path(path: str) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj, *, indent: int = 1) -> None:
    """Write ``obj`` as JSON (sorted keys) under a temporary name, fsync, rename, fsync the dir."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=indent, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))
