"""Verdicts of the compile checks, kept so that unchanged kernels are not compiled again.

The NVRTC check (:func:`ringmpi.gpu.nvrtc.check`) and the nvcc check
(:func:`ringmpi.gpu.nvcc.check`) compile every kernel instantiation: minutes of CPU
on every run of the suite, for sources that rarely change. A compiler is a function of
its input, so a passing verdict is stored under the SHA-256 of everything that decides
it (the compiler's identity and version, the source text with its header spliced in, the
options, the architecture and the instantiations) and reused while all of that stays
the same; any change is a new key, compiled afresh. Failures are never stored.

The verdicts live in ``checks/`` of the kernel cache directory
(:func:`ringmpi.gpu.loader.cache_dir`), a directory only this user can change, and are
read only from this user's regular files there (no symlink followed); anything
unreadable, malformed or unsafe counts as absent. ``RINGMPI_CHECK_CACHE=0`` turns the
reuse off (every check compiles).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from ..runtime import env
from ..runtime.files import UnsafePathError, open_private_dir, open_private_file, write_private

__all__ = ["key", "load", "store", "enabled"]

_VERSION = 1
_HINT = "set RINGMPI_CACHE_DIR to a private directory, or RINGMPI_CHECK_CACHE=0"


def enabled() -> bool:
    """Whether verdicts are reused (``RINGMPI_CHECK_CACHE``, default on)."""
    return bool(env.get("RINGMPI_CHECK_CACHE"))


def key(*parts) -> str:
    """SHA-256 (hex) of ``parts`` (strings, or sequences of strings), in order."""
    h = hashlib.sha256(f"ringmpi-verdict-{_VERSION}".encode())
    for p in parts:
        items = [p] if isinstance(p, str) else list(p)
        h.update(f"\0{len(items)}".encode())
        for s in items:
            data = str(s).encode()
            h.update(f"\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def _dir():
    from .loader import cache_dir

    return cache_dir() / "checks"


def load(digest: str) -> Optional[dict]:
    """The stored verdict of ``digest``, or None (absent, unsafe, malformed, or reuse off)."""
    if not enabled():
        return None
    path = _dir() / f"{digest}.json"
    try:
        dirfd = open_private_dir(str(path.parent), create=False, hint=_HINT)
    except (OSError, UnsafePathError):
        return None
    try:
        fd = open_private_file(dirfd, path.name, str(path))
        try:
            info = json.loads(os.pread(fd, 1 << 24, 0))
        finally:
            os.close(fd)
    except (OSError, ValueError, UnsafePathError):
        return None
    finally:
        os.close(dirfd)
    if not isinstance(info, dict) or info.get("key") != digest or info.get("ok") is not True:
        return None
    value = info.get("value")
    return value if isinstance(value, dict) else None


def store(digest: str, value: dict) -> None:
    """Keep the passing verdict ``value`` (JSON-able) under ``digest``; silent on failure."""
    if not enabled():
        return
    path = _dir() / f"{digest}.json"
    data = json.dumps({"key": digest, "ok": True, "value": value}).encode()
    try:
        dirfd = open_private_dir(str(path.parent), create=True, hint=_HINT)
        try:
            write_private(dirfd, path.name, data)
        finally:
            os.close(dirfd)
    except (OSError, UnsafePathError):  # a read-only or unsafe cache: compile next time
        pass
