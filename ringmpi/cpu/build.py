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
and then loads the finished file. No MPI collective is involved, so the build may be
triggered lazily by any subset of ranks.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from ..kernel_files import kernel_path

try:
    import fcntl
except ImportError:  # not POSIX: the atomic rename alone keeps concurrent builds correct
    fcntl = None

__all__ = ["ISAS", "FLAGS", "host_isas", "resolve_isa", "isa_setting", "build_library"]

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


class _FileLock:
    """Exclusive flock on ``path`` for the duration of a ``with`` block.

    Where the file system refuses locks (some network mounts) the block runs unlocked:
    builds stay correct through the atomic rename, at worst compiling more than once.
    """

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        if fcntl is None:
            return self
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as exc:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EACCES):
                raise
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def build_library(source_name: str, isa: Optional[str] = None) -> Path:
    """Compile ``kernels/<source_name>`` for one ISA path, or return the cached library.

    Same flags, cache and lock for every kernel source: the library is
    ``$RINGMPI_CACHE_DIR/<stem>-<isa>-<key>.so`` where the key hashes the source, the
    compiler's identity, the flags and the host CPU flags. The first process to need it
    compiles while holding ``<library>.lock``; the others (ranks of the node, other jobs)
    wait on the lock and use the finished file. A ready file is used without compiling.

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
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with _FileLock(target.with_name(target.name + ".lock")):
        if target.is_file():  # built by another process while this one waited
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=out_dir)
        os.close(fd)
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
            os.replace(tmp, target)  # atomic: readers see a complete file or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
