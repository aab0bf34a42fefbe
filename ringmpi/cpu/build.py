"""Compiling the CPU kernels: ISA paths, compiler flags, the on-disk cache and its lock.

Each ``kernels/*.c`` source is built with the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) with ``-O3`` and the flags of one ISA path (no
``-ffast-math``: inf and NaN keep their IEEE meaning):

* ``avx512``: ``-march=native`` on a host with AVX-512F (16 float32 lanes);
* ``avx2``: ``-march=native -mno-avx512f`` (AVX2 + FMA, 8 lanes);
* ``scalar``: ``-march=native -mno-avx`` on x86 (one element at a time, libm exp).

``$RINGMPI_CPU_ISA`` (``auto`` | ``avx512`` | ``avx2`` | ``scalar``) picks the path;
``auto`` is the best one the host can execute, and a path the host cannot execute
is refused with a clear error.

The ISA paths are :mod:`ringmpi.cpu.isa`, the cache directory, its lock and
the checks of a cached library :mod:`ringmpi.cpu.cache`. Libraries are cached
under ``$RINGMPI_CACHE_DIR`` (default ``~/.cache/ringmpi``).
The cache key hashes the source, the compiler's identity, the flags (ISA path and
``$RINGMPI_CFLAGS`` included) and the host CPU's feature flags, so a shared home
directory on a heterogeneous cluster gets one build per CPU type. One compile per
cache file: the builder holds an exclusive ``flock`` on ``<library>.lock`` while it
compiles to a private temporary name and renames it into place; every other process
(the other MPI ranks of the node, other jobs sharing the cache) waits on that lock
(at most ``$RINGMPI_BUILD_LOCK_S``, 600 s) and then loads the finished file. No MPI
collective is involved, so the build may be triggered lazily by any subset of ranks.

The cache holds code that will run: it must be private. The directory is created
0700 and refused when it belongs to another user or is writable by group or others;
files in it are opened relative to its descriptor without following symlinks; the
build records the library's SHA-256 in the lock file and a cached library is used
only when its owner, mode and hash (computed on the opened descriptor) match.
:func:`load_verified` loads it through that same descriptor (``/proc/self/fd/N`` on
Linux), so a file swapped in under the name after the check is never the one loaded.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from ..files import UnsafePathError, exclusive_temp, open_private_dir, sha256_fd
from ..kernel_files import kernel_path
from . import cache
from .cache import load_verified
from .isa import ISAS, cpu_flags, host_isas, isa_flags, isa_setting, resolve_isa

__all__ = [
    "ISAS", "FLAGS", "host_isas", "resolve_isa", "isa_setting", "build_library", "load_verified",
]  # fmt: skip

FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast"]


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    raise FileNotFoundError("no C compiler found (install gcc or clang, or set $CC)")


def build_library(source_name: str, isa: Optional[str] = None) -> Path:
    """Compile ``kernels/<source_name>`` for one ISA path, or return the cached library.

    Same flags, cache and lock for every kernel source: the library is
    ``$RINGMPI_CACHE_DIR/<stem>-<isa>-<key>.so`` where the key hashes the source, the
    compiler's identity, the flags and the host CPU flags. The first process to need it
    compiles while holding ``<library>.lock``; the others (ranks of the node, other jobs)
    wait on the lock and use the finished file. A ready file is used without compiling
    only when it is what the build produced: the cache directory is this user's and
    not writable by group or others (created 0700), the library is a regular file of
    this user (not a symlink) and its SHA-256, computed on the opened descriptor,
    equals the one the build recorded in the lock file. Otherwise it is rebuilt.

    Parameters
    ----------
    source_name : str
        File name under ``kernels/`` (or ``$RINGMPI_KERNEL_DIR``), e.g. ``"cpu_tile.c"``.
    isa : str, optional
        ``auto``, ``avx512``, ``avx2`` or ``scalar``; default ``$RINGMPI_CPU_ISA`` (auto).

    Returns
    -------
    pathlib.Path
        The shared library.

    Raises
    ------
    ValueError
        Unknown ISA path, or one the host cannot execute.
    FileNotFoundError
        No source or no C compiler.
    RuntimeError
        The compiler failed (its error output is in the message).
    PermissionError
        (:class:`ringmpi.files.UnsafePathError`) the cache directory belongs to another
        user or is writable by group or others.
    TimeoutError
        Another process held the build lock longer than ``$RINGMPI_BUILD_LOCK_S``.
    """
    name = resolve_isa(isa)
    src = kernel_path(source_name)
    cc = _compiler()
    flags = FLAGS + isa_flags(name) + os.environ.get("RINGMPI_CFLAGS", "").split()
    version = subprocess.run(
        [*cc.split(), "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    for part in (src.read_bytes(), cc, version, " ".join(flags), cpu_flags(), platform.machine()):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    out_dir = cache.cache_dir()
    target = out_dir / f"{Path(source_name).stem}-{name}-{key.hexdigest()[:20]}.so"
    lock_name = target.name + ".lock"
    dirfd = open_private_dir(str(out_dir), create=True, hint=cache.HINT)
    try:
        if cache.verified(dirfd, target.name, lock_name, str(target)):
            return target
        with cache.FileLock(dirfd, lock_name, str(target) + ".lock") as lock:
            if cache.verified(dirfd, target.name, lock_name, str(target)):
                return target  # built by another process while this one waited
            _compile(cc, flags, src, dirfd, out_dir, target, lock.fd)
    finally:
        os.close(dirfd)
    return target


def _compile(cc, flags, src, dirfd: int, out_dir: Path, target: Path, lock_fd) -> None:
    """Compile into an exclusive temporary, record its hash in the lock file, rename it."""
    fd, tmp = exclusive_temp(str(target), 0o700)
    os.close(fd)
    tmp_name = os.path.basename(tmp)
    try:
        proc = subprocess.run(
            [*cc.split(), *flags, "-o", tmp, str(src), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"compiling {src} with {cc} {' '.join(flags)} failed:\n{proc.stderr[-4000:]}"
            )
        # the linker recreates the output with its own mode (0775 under umask 002)
        fd = os.open(tmp_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise UnsafePathError(f"{tmp}: the compiler's output is not this user's")
            os.fchmod(fd, 0o700)
            digest = sha256_fd(fd)
        finally:
            os.close(fd)
        record = f"{digest}  {target.name}\n".encode()
        if lock_fd is not None:
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, record, 0)
            os.fsync(lock_fd)
        # atomic: readers see a complete file or none
        os.replace(tmp_name, target.name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    finally:
        try:
            os.unlink(tmp_name, dir_fd=dirfd)
        except FileNotFoundError:
            pass
