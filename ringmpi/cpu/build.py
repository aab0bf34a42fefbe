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
The cache key hashes the source and every local header it includes
(:func:`kernel_sources`: ``#include "name"``, read from the source's own directory),
the compiler's identity, the flags (ISA path and ``$RINGMPI_CFLAGS`` included) and the
host CPU's feature flags, so a changed header gives a new library and a shared home
directory on a heterogeneous cluster gets one build per CPU type. The compiler reads
the very bytes that were hashed: copies written to a private directory inside the cache.
One compile per cache file: the builder holds an exclusive ``flock`` on ``<library>.lock`` while it
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
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from ..runtime.files import UnsafePathError, exclusive_temp, open_private_dir, sha256_fd
from ..runtime.kernel_files import kernel_path
from . import cache
from .isa import cpu_flags, isa_flags, resolve_isa

__all__ = [
    "FLAGS",
    "build_library",
    "kernel_sources",
]

FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast"]


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    raise FileNotFoundError("no C compiler found (install gcc or clang, or set $CC)")


# `#include "name"`: the kernels' own headers (system headers are included with <...>)
_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"\n]*)"', re.M)


def kernel_sources(source_name: str) -> dict[str, bytes]:
    """The text of kernel source ``source_name`` and of every local header it includes.

    The source is found by :func:`ringmpi.runtime.kernel_files.kernel_path`; the headers it names
    with ``#include "name"`` (and those they name, recursively) are read from that same
    directory only, so a header is never taken from another of the places searched.

    Parameters
    ----------
    source_name : str
        File name under ``kernels/`` (or ``$RINGMPI_KERNEL_DIR``), e.g. ``"cpu_tile.c"``.

    Returns
    -------
    dict of str to bytes
        File name -> contents, the source first, then the headers in the order found.

    Raises
    ------
    FileNotFoundError
        No such source, or a header it includes is not next to it.
    ValueError
        An included name with a directory part (``#include "../x.h"``).
    """
    src = kernel_path(source_name)
    texts: dict[str, bytes] = {}
    todo = [src.name]
    while todo:
        name = todo.pop(0)
        if name in texts:
            continue
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(
                f'{src}: #include "{name}": a kernel header is named without a directory'
            )
        try:
            texts[name] = (src.parent / name).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{src}: included header {name} not found in {src.parent}"
            ) from None
        todo += [m.decode("utf-8", "replace") for m in _LOCAL_INCLUDE.findall(texts[name])]
    return texts


def build_library(source_name: str, isa: Optional[str] = None, extra_flags=()) -> Path:
    """Compile ``kernels/<source_name>`` for one ISA path, or return the cached library.

    Same flags, cache and lock for every kernel source: the library is
    ``$RINGMPI_CACHE_DIR/<stem>-<isa>-<key>.so`` where the key hashes the source and the
    local headers it includes (:func:`kernel_sources`), the compiler's identity, the flags
    and the host CPU flags. The first process to need it
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
    extra_flags : sequence of str
        Flags the kernel needs, placed after ``$RINGMPI_CFLAGS`` so that they win (the
        reproducible kernel's ``-ffp-contract=off``); part of the cache key.

    Returns
    -------
    pathlib.Path
        The shared library.

    Raises
    ------
    ValueError
        Unknown ISA path, or one the host cannot execute.
    FileNotFoundError
        No source, a header it includes missing, or no C compiler.
    ValueError
        Also: an ``#include "..."`` naming a directory (:func:`kernel_sources`).
    RuntimeError
        The compiler failed (its error output is in the message).
    PermissionError
        (:class:`ringmpi.runtime.files.UnsafePathError`) the cache directory belongs to another
        user or is writable by group or others.
    TimeoutError
        Another process held the build lock longer than ``$RINGMPI_BUILD_LOCK_S``.
    """
    name = resolve_isa(isa)
    src = kernel_path(source_name)
    texts = kernel_sources(source_name)
    cc = _compiler()
    flags = FLAGS + isa_flags(name) + os.environ.get("RINGMPI_CFLAGS", "").split()
    flags += list(extra_flags)
    version = subprocess.run(
        [*cc.split(), "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    for fname, text in texts.items():
        key.update(fname.encode() + b"\0" + text + b"\0")
    for part in (cc, version, " ".join(flags), cpu_flags(), platform.machine()):
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
            _compile(cc, flags, src, texts, dirfd, out_dir, target, lock.fd)
    finally:
        os.close(dirfd)
    return target


def _write_sources(texts: dict, out_dir: Path) -> str:
    """Write the hashed sources into a new private directory inside the cache; its path."""
    d = tempfile.mkdtemp(prefix=".src-", dir=str(out_dir))  # mode 0700, a fresh name
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for name, text in texts.items():
        with open(os.open(os.path.join(d, name), flags, 0o600), "wb") as f:
            f.write(text)
    return d


def _compile(cc, flags, src, texts, dirfd: int, out_dir: Path, target: Path, lock_fd) -> None:
    """Compile into an exclusive temporary, record its hash in the lock file, rename it.

    The compiler reads the copies of ``texts`` (the hashed bytes), not the kernel directory.
    """
    fd, tmp = exclusive_temp(str(target), 0o700)
    os.close(fd)
    tmp_name = os.path.basename(tmp)
    src_dir = None
    try:
        src_dir = _write_sources(texts, out_dir)
        proc = subprocess.run(
            [*cc.split(), *flags, "-o", tmp, os.path.join(src_dir, src.name), "-lm"],
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
        if src_dir is not None:
            shutil.rmtree(src_dir, ignore_errors=True)
