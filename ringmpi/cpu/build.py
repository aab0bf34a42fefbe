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

Libraries are cached under ``$RINGMPI_CACHE_DIR`` (default ``~/.cache/ringmpi``).
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

import ctypes
import errno
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ..files import UnsafePathError, exclusive_temp, open_private_dir, open_private_file, sha256_fd
from ..kernel_files import kernel_path

try:
    import fcntl
except ImportError:  # not POSIX: the atomic rename alone keeps concurrent builds correct
    fcntl = None

__all__ = [
    "ISAS", "FLAGS", "host_isas", "resolve_isa", "isa_setting", "build_library", "load_verified",
]  # fmt: skip

#: ISA paths of the kernels, widest first
ISAS = ("avx512", "avx2", "scalar")

FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast"]
# flags per ISA path on x86 (-mno-avx512f also drops every AVX-512 subset; -mno-avx drops
# AVX2, FMA and AVX-512: the kernel's #if's then select its plain C path)
_ISA_FLAGS = {
    "avx512": ["-march=native"],
    "avx2": ["-march=native", "-mno-avx512f"],
    "scalar": ["-march=native", "-mno-avx"],
}
# CPU feature flags (as /proc/cpuinfo names them) each path executes
_ISA_NEEDS = {"avx512": ("avx512f", "avx2", "fma"), "avx2": ("avx2", "fma"), "scalar": ()}


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _cpu_flags() -> str:
    """Host CPU identity for the cache key: -march=native depends on it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def _host_features() -> Optional[frozenset]:
    """CPU feature flags of the host from /proc/cpuinfo, or None when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def host_isas() -> tuple[str, ...]:
    """ISA paths this host can execute, widest first (always ends with ``"scalar"``).

    On x86 the features come from /proc/cpuinfo (the kernel's view, which includes the
    operating system's support for the wide registers); elsewhere, or when they are
    unknown, only ``scalar`` is listed.
    """
    feats = _host_features()
    if not _is_x86() or feats is None:
        return ("scalar",)
    return tuple(name for name in ISAS if all(f in feats for f in _ISA_NEEDS[name]))


def isa_setting() -> str:
    """``$RINGMPI_CPU_ISA`` as given (lower case; ``auto`` when unset)."""
    return os.environ.get("RINGMPI_CPU_ISA", "auto").strip().lower()


def resolve_isa(isa: Optional[str]) -> str:
    """Map None/``auto`` (or ``$RINGMPI_CPU_ISA``) to a path the host can execute."""
    name = isa.strip().lower() if isa is not None else isa_setting()
    if name in ("", "auto"):
        return host_isas()[0]
    if name not in ISAS:
        raise ValueError(
            f"unknown CPU ISA path {name!r} (RINGMPI_CPU_ISA): use auto, " + ", ".join(ISAS)
        )
    have = host_isas()
    if name not in have:
        if not _is_x86():
            why = f"this is a {platform.machine()} host"
        elif _host_features() is None:
            why = "its CPU features are unknown (no /proc/cpuinfo)"
        else:
            missing = [f for f in _ISA_NEEDS[name] if f not in _host_features()]
            why = "it lacks " + ", ".join(missing)
        raise ValueError(
            f"CPU ISA path {name!r} cannot run on this host: {why}; it can run " + ", ".join(have)
        )
    return name


def _isa_flags(isa: str) -> list[str]:
    return list(_ISA_FLAGS[isa]) if _is_x86() else ["-march=native"]


# --------------------------------------------------------------------------- building


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    raise FileNotFoundError("no C compiler found (install gcc or clang, or set $CC)")


def _cache_dir() -> Path:
    d = os.environ.get("RINGMPI_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "ringmpi"


_HINT = (
    "compiled kernels are only loaded from a directory only you can change: chmod 700 it "
    "(after checking its contents) or set RINGMPI_CACHE_DIR to a private directory"
)


def _lock_wait_s() -> float:
    """``$RINGMPI_BUILD_LOCK_S``: the longest wait for another process's build (default 600)."""
    raw = os.environ.get("RINGMPI_BUILD_LOCK_S", "600").strip()
    try:
        val = float(raw)
    except ValueError:
        val = math.nan
    if not math.isfinite(val) or val <= 0:
        raise ValueError(f"RINGMPI_BUILD_LOCK_S must be a positive number of seconds, not {raw!r}")
    return min(val, 86400.0)


class _FileLock:
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
        deadline, warned = time.monotonic() + _lock_wait_s(), False
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


def _recorded(dirfd: int, lock_name: str, what: str) -> Optional[str]:
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


def _verified(dirfd: int, name: str, lock_name: str, what: str) -> bool:
    """True if library ``name`` is ours, private, and hashes to what its build recorded."""
    want = _recorded(dirfd, lock_name, what + ".lock")
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


def _fd_path(fd: int) -> Optional[str]:
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
        (:class:`ringmpi.files.UnsafePathError`) the directory or file is not private,
        is a symlink, or does not hash to what its build recorded.
    """
    path = Path(path)
    what = str(path)
    dirfd = open_private_dir(str(path.parent), create=False, hint=_HINT)
    try:
        want = _recorded(dirfd, path.name + ".lock", what + ".lock")
        fd = open_private_file(dirfd, path.name, what)
    finally:
        os.close(dirfd)
    try:
        if want is None or sha256_fd(fd) != want:
            raise UnsafePathError(
                f"{what}: not the library its build recorded (SHA-256 differs): refusing to load it"
            )
        via = _fd_path(fd)
        lib = ctypes.CDLL(via or what)
    except BaseException:
        os.close(fd)
        raise
    if via is None:
        os.close(fd)
    else:
        _HELD.append(fd)
    return lib


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
    flags = FLAGS + _isa_flags(name) + os.environ.get("RINGMPI_CFLAGS", "").split()
    version = subprocess.run(
        [*cc.split(), "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    for part in (src.read_bytes(), cc, version, " ".join(flags), _cpu_flags(), platform.machine()):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    out_dir = _cache_dir()
    target = out_dir / f"{Path(source_name).stem}-{name}-{key.hexdigest()[:20]}.so"
    lock_name = target.name + ".lock"
    dirfd = open_private_dir(str(out_dir), create=True, hint=_HINT)
    try:
        if _verified(dirfd, target.name, lock_name, str(target)):
            return target
        with _FileLock(dirfd, lock_name, str(target) + ".lock") as lock:
            if _verified(dirfd, target.name, lock_name, str(target)):
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
