"""The private on-disk cache of compiled CPU kernels: its directory, build lock and checks.

Libraries are cached under ``$RINGMPI_CACHE_DIR`` (default ``~/.cache/ringmpi``).
One compile per cache file: the builder holds an exclusive ``flock`` on
``<library>.lock`` (:class:`FileLock`) while it compiles, and every other process
waits on that lock (at most ``$RINGMPI_BUILD_LOCK_S``, 600 s). The cache holds code
that will run: it must be private. The directory is created 0700 and refused when it
belongs to another user or is writable by group or others; files in it are opened
relative to its descriptor without following symlinks; the build records the
library's SHA-256 in the lock file, and a cached library is used only when its
owner, mode and hash (computed on the opened descriptor) match (:func:`verified`).
:func:`load_verified` loads it through that same descriptor (``/proc/self/fd/N`` on
Linux), so a file swapped in under the name after the check is never the one loaded.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

from ..runtime.files import UnsafePathError, open_private_dir, open_private_file, sha256_fd

try:
    import fcntl
except ImportError:  # not POSIX: the atomic rename alone keeps concurrent builds correct
    fcntl = None

__all__ = [
    "HINT",
    "cache_dir",
    "lock_wait_s",
    "FileLock",
    "recorded",
    "verified",
    "fd_path",
    "load_verified",
]


def cache_dir() -> Path:
    """``$RINGMPI_CACHE_DIR``, else ``~/.cache/ringmpi``."""
    d = os.environ.get("RINGMPI_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "ringmpi"


HINT = (
    "compiled kernels are only loaded from a directory only you can change: chmod 700 it "
    "(after checking its contents) or set RINGMPI_CACHE_DIR to a private directory"
)


def lock_wait_s() -> float:
    """``$RINGMPI_BUILD_LOCK_S``: the longest wait for another process's build (default 600)."""
    raw = os.environ.get("RINGMPI_BUILD_LOCK_S", "600").strip()
    try:
        val = float(raw)
    except ValueError:
        val = math.nan
    if not math.isfinite(val) or val <= 0:
        raise ValueError(f"RINGMPI_BUILD_LOCK_S must be a positive number of seconds, not {raw!r}")
    return min(val, 86400.0)


class FileLock:
    """Exclusive flock on file ``name`` in directory ``dirfd`` for a ``with`` block.

    The lock file is opened with ``O_NOFOLLOW`` (mode 0600) in the private cache
    directory and must belong to this user. The wait is bounded by
    ``$RINGMPI_BUILD_LOCK_S``: after 10 s one line says who is waiting for what, at the
    end a ``TimeoutError`` names the lock. Where the file system refuses locks (some
    network mounts) the block runs unlocked: builds stay correct through the atomic
    rename, at worst compiling more than once. While held, :attr:`fd` is the lock
    file's descriptor (it also records the content hash of the built library).
    """

    def __init__(self, dirfd: int, name: str, what: str):
        self.dirfd, self.name, self.what, self.fd = dirfd, name, what, None

    def __enter__(self):
        self.fd = open_private_file(self.dirfd, self.name, self.what, os.O_RDWR | os.O_CREAT)
        if fcntl is None:
            return self
        deadline, warned = time.monotonic() + lock_wait_s(), False
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES):
                    return self
                self._close()
                raise
            now = time.monotonic()
            if now >= deadline:
                self._close()
                raise TimeoutError(
                    f"{self.what}: still locked by another build after {now - start:.0f} s "
                    "(RINGMPI_BUILD_LOCK_S); remove the lock file if no build is running"
                )
            if not warned and now - start > 10:
                print(f"ringmpi: waiting for another build's lock {self.what}", file=sys.stderr)
                warned = True
            time.sleep(0.05)

    def _close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __exit__(self, *exc):
        if self.fd is not None and fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except OSError:
                pass
        self._close()


def recorded(dirfd: int, lock_name: str, what: str) -> Optional[str]:
    """The content hash recorded in the lock file at build time, or None."""
    try:
        fd = open_private_file(dirfd, lock_name, what)
    except (OSError, UnsafePathError):
        return None
    try:
        text = os.pread(fd, 256, 0).decode("ascii", "replace").split()
    finally:
        os.close(fd)
    return text[0] if text and len(text[0]) == 64 else None


def verified(dirfd: int, name: str, lock_name: str, what: str) -> bool:
    """True if library ``name`` is ours, private, and hashes to what its build recorded."""
    want = recorded(dirfd, lock_name, what + ".lock")
    if want is None:
        return False
    try:
        fd = open_private_file(dirfd, name, what)
    except (OSError, UnsafePathError):
        return False
    try:
        return sha256_fd(fd) == want
    finally:
        os.close(fd)


# descriptors of loaded libraries, never closed: the dynamic loader knows a library by
# the name it was opened under, so a reused /proc/self/fd/N would give the old library
_HELD: list = []


def fd_path(fd: int) -> Optional[str]:
    """``/proc/self/fd/N`` for descriptor ``fd`` where the platform has it (Linux), else None."""
    p = f"/proc/self/fd/{fd}"
    return p if sys.platform.startswith("linux") and os.path.exists(p) else None


def load_verified(path) -> ctypes.CDLL:
    """Load the cached library ``path`` through the descriptor its hash was checked on.

    The library must be this user's private regular file in a private cache
    directory, and its SHA-256 (computed on the opened descriptor) must equal the one
    its build recorded in ``<library>.lock``. On Linux the loader then opens
    ``/proc/self/fd/N``, the very file that was hashed, whatever is under the name by
    then; the descriptor stays open for the life of the process. Elsewhere the path
    itself is loaded (checked just before).

    Parameters
    ----------
    path : str or pathlib.Path
        A library returned by :func:`build_library`.

    Returns
    -------
    ctypes.CDLL
        The library (its ``_name`` is the ``/proc/self/fd`` path on Linux).

    Raises
    ------
    PermissionError
        (:class:`ringmpi.runtime.files.UnsafePathError`) the directory or file is not private,
        is a symlink, or does not hash to what its build recorded.
    """
    path = Path(path)
    what = str(path)
    dirfd = open_private_dir(str(path.parent), create=False, hint=HINT)
    try:
        want = recorded(dirfd, path.name + ".lock", what + ".lock")
        fd = open_private_file(dirfd, path.name, what)
    finally:
        os.close(dirfd)
    try:
        if want is None or sha256_fd(fd) != want:
            raise UnsafePathError(
                f"{what}: not the library its build recorded (SHA-256 differs): refusing to load it"
            )
        via = fd_path(fd)
        lib = ctypes.CDLL(via or what)
    except BaseException:
        os.close(fd)
        raise
    if via is None:
        os.close(fd)
    else:
        _HELD.append(fd)
    return lib
