"""Load CUDA kernels from ``kernels/`` on the current device, compiled once and cached on disk.

The source text and options come from :mod:`ringmpi.gpu.sources` (``#line``
directives, several files as one translation unit). Templates are
instantiated through NVRTC name expressions, e.g. ``"attn_fwd_mma<half_t, 64>"``.

Each instantiation is compiled on first use only, by NVRTC for the device's
exact architecture (:mod:`ringmpi.gpu.nvrtc`), and the cubin is kept in the
cache directory (``$RINGMPI_CACHE_DIR``, else ``$CUPY_CACHE_DIR``, else
``~/.cupy/kernel_cache``) under a hash of the source, options, name, arch and
NVRTC version, so later processes (every rank, every run) load it in
milliseconds. The cache directory must be private (this user's, not writable by
group or others; created 0700) and a cubin is loaded only when its SHA-256 matches
the one recorded beside it at compile time and the recorded symbol names the
requested kernel (:func:`_lookup`); an unsafe cache costs a compile per process.
(CuPy's own cache is bypassed for name expressions: a
``cupy.RawModule`` with them recompiles in every process.) If that path fails
(no standalone libnvrtc, an arch this NVRTC does not know, a cubin the driver
refuses), the kernel is compiled by ``cupy.RawModule`` instead.
CuPy is imported lazily.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Union

from ..runtime.files import open_private_dir, open_private_file, sha256_fd, write_private
from .sources import OPTIONS, source

__all__ = [
    "get_function",
    "precompile",
    "cache_dir",
    "last_path",
]

_VERSION = 1
last_path: dict = {}  # expression -> "cache" | "compiled" | "cupy: <why>" (diagnostics)


def cache_dir() -> Path:
    """Directory of the compiled kernels (and of the autotune choices)."""
    base = os.environ.get("RINGMPI_CACHE_DIR") or os.environ.get("CUPY_CACHE_DIR")
    return Path(base or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))


_HINT = (
    "cubins are only loaded from a directory only you can change: chmod 700 it or set "
    "RINGMPI_CACHE_DIR to a private directory"
)
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _symbol_ok(expr: str, mangled: str) -> bool:
    """True if ``mangled`` can be the lowered name of name expression ``expr``.

    The symbol of a cached kernel comes from its metadata file; it must name the
    function the expression names (``f<...>`` lowers to ``_Z<len>f...``, ``ns::f<...>`` to
    ``_ZN<len>ns<len>f...``, a plain ``extern "C"`` kernel to its own name), so a
    metadata file cannot pick another kernel of the module.
    """
    if not isinstance(mangled, str) or not _SYMBOL.fullmatch(mangled):
        return False
    parts = expr.split("<", 1)[0].strip().split("::")
    if not all(_SYMBOL.fullmatch(p) for p in parts):
        return False
    if len(parts) == 1 and mangled == parts[0]:
        return True
    enc = "".join(f"{len(p)}{p}" for p in parts)
    return mangled.startswith(("_Z" if len(parts) == 1 else "_ZN") + enc)


def _paths(code: str, expr: str, arch: str) -> tuple:
    """(cubin path, metadata path) of one instantiation in the cache directory."""
    from . import nvrtc

    ver = ".".join(map(str, nvrtc.version()))
    key = hashlib.sha256("\0".join((code, *OPTIONS, expr, arch, ver, str(_VERSION))).encode())
    base = cache_dir() / f"ringmpi_{key.hexdigest()[:40]}"
    return base.with_suffix(".cubin"), base.with_suffix(".json")


def _lookup(code: str, expr: str, arch: str):
    """(cubin path, mangled name) if cached, else None.

    A cached cubin is used only from a private cache directory (this user's, not
    writable by group or others), when both files are this user's regular files
    (symlinks are not followed), the metadata names this ``expr`` and ``arch`` with
    a symbol that :func:`_symbol_ok` accepts, and the cubin's SHA-256 (computed on
    the opened descriptor) is the one recorded at compile time.

    Raises
    ------
    ringmpi.runtime.files.UnsafePathError
        The cache directory belongs to another user or is group/other-writable.
    """
    cubin, meta = _paths(code, expr, arch)
    try:
        dirfd = open_private_dir(str(cubin.parent), create=False, hint=_HINT)
    except FileNotFoundError:
        return None
    try:
        fd = open_private_file(dirfd, meta.name, str(meta))
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0))
        finally:
            os.close(fd)
        if not isinstance(info, dict) or (info.get("expr"), info.get("arch")) != (expr, arch):
            return None
        mangled, want = info.get("mangled"), info.get("sha256")
        if not _symbol_ok(expr, mangled) or not isinstance(want, str):
            return None
        fd = open_private_file(dirfd, cubin.name, str(cubin))
        try:
            ok = sha256_fd(fd) == want
        finally:
            os.close(fd)
    except (OSError, ValueError):  # absent, a symlink, another owner's, not JSON
        return None
    finally:
        os.close(dirfd)
    return (cubin, mangled) if ok else None


def _compile(code: str, expr: str, arch: str) -> tuple:
    """Compile one instantiation with NVRTC and store it; (cubin path, mangled name)."""
    from . import nvrtc

    res = nvrtc.compile_source(code, (expr,), arch, OPTIONS, verbose_ptxas=False, keep_cubin=True)
    if not res.ok or expr not in res.lowered:
        raise RuntimeError(f"NVRTC could not compile {expr} for {arch}:\n{res.log}")
    mangled = res.lowered[expr]
    if not _symbol_ok(expr, mangled):
        raise RuntimeError(f"NVRTC lowered {expr} to an unexpected symbol {mangled!r}")
    cubin, meta = _paths(code, expr, arch)
    digest = hashlib.sha256(res.cubin).hexdigest()
    info = {"expr": expr, "arch": arch, "mangled": mangled, "sha256": digest}
    try:
        dirfd = open_private_dir(str(cubin.parent), create=True, hint=_HINT)
        try:
            write_private(dirfd, cubin.name, res.cubin)
            write_private(dirfd, meta.name, json.dumps(info).encode())
        finally:
            os.close(dirfd)
    except OSError:  # a read-only or unsafe cache: a private copy, compile again next time
        fd, name = tempfile.mkstemp(suffix=".cubin")  # 0600, O_EXCL
        with os.fdopen(fd, "wb") as f:
            f.write(res.cubin)
        cubin = Path(name)
    return cubin, mangled


def _arch(dev: int) -> str:
    from . import device

    return f"sm_{device.check_arch(dev)}"


def _cached(code: str, expr: str, dev: int):
    """(cupy.RawModule loaded from a cached or fresh cubin, mangled name of ``expr``)."""
    import cupy

    arch = _arch(dev)
    hit = _lookup(code, expr, arch)
    last_path[expr] = "cache" if hit else "compiled"
    cubin, mangled = hit or _compile(code, expr, arch)
    return cupy.RawModule(path=str(cubin)), mangled


def precompile(names: Union[str, tuple], exprs: tuple, dev: int, workers: int = 0) -> dict:
    """Compile every instantiation in ``exprs`` not yet cached, in parallel threads.

    Returns {expr: "cache" | "compiled" | error message}. Needs no CuPy context,
    only the device's compute capability (``dev``).
    """
    from concurrent.futures import ThreadPoolExecutor

    from . import nvrtc

    code, arch = source(names), _arch(dev)
    nvrtc.version()  # load libnvrtc before the threads start

    def one(expr):
        try:
            if _lookup(code, expr, arch):
                return "cache"
            _compile(code, expr, arch)
            return "compiled"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(workers or max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(exprs, pool.map(one, exprs)))


@functools.cache
def _function(names: Union[str, tuple], dev: int, expr: str):
    import cupy

    code = source(names)
    if os.environ.get("RINGMPI_KERNEL_CACHE", "1") != "0":
        try:
            mod, mangled = _cached(code, expr, dev)
            return mod.get_function(mangled)
        except Exception as exc:  # fall back to CuPy's compiler
            last_path[expr] = f"cupy: {type(exc).__name__}: {exc}"[:300]
    else:
        last_path[expr] = "cupy: RINGMPI_KERNEL_CACHE=0"
    mod = cupy.RawModule(code=code, options=OPTIONS, name_expressions=(expr,))
    return mod.get_function(expr)


def get_function(names: Union[str, tuple], expr: str, exprs: tuple = ()):
    """Kernel ``expr`` from the module of ``names`` on the current device (compiled once).

    ``exprs`` (every instantiation of the module) is accepted for compatibility
    and checked: ``expr`` must be one of them when given.
    """
    import cupy

    if exprs and expr not in exprs:
        raise ValueError(f"{expr} is not an instantiation of {names}")
    return _function(names, cupy.cuda.Device().id, expr)
