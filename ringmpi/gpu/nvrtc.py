"""Compile CUDA sources with NVRTC directly: no device, no CuPy, no CUDA toolkit.

Used by the CI compile check (tests/gpu/test_nvrtc.py) and by ``python -m
ringmpi.gpu.nvrtc`` to report register and spill counts. ``libnvrtc`` is looked up,
in order: ``$RINGMPI_NVRTC`` (a file), the NVIDIA pip wheels
(``nvidia-cuda-nvrtc-cu12`` -> ``nvidia/cuda_nvrtc/lib``, ``nvidia-cuda-nvrtc``
-> ``nvidia/cu13/lib``), ``$CUDA_PATH``/``$CUDA_HOME``, ``/usr/local/cuda*``,
then the system loader. The kernels include no header, so no include path is
needed. NVRTC loads ``libnvrtc-builtins.so.<version>`` by name when it compiles;
libnvrtc from a wheel has no RUNPATH, so that lookup fails unless the directory
is on ``LD_LIBRARY_PATH``: :func:`preload_builtins` loads the builtins from the
directory of the libnvrtc found first (a library already loaded is found by its
soname).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from . import configs
from .sources import BACKWARD_FILES, FORWARD_FILE, OPTIONS, source

__all__ = [
    "NvrtcError",
    "CompileResult",
    "find_library",
    "preload_builtins",
    "version",
    "compile_source",
    "sources",
    "check",
]

ARCHS = ("sm_80", "sm_90")


class NvrtcError(RuntimeError):
    """NVRTC could not be loaded or a call into it failed."""


@dataclass
class CompileResult:
    """Outcome of one NVRTC compile: ok flag, log, lowered names, ptxas resources."""

    arch: str
    ok: bool
    log: str
    lowered: dict = field(default_factory=dict)  # name expression -> mangled name
    binary_size: int = 0
    resources: dict = field(default_factory=dict)  # mangled name -> {registers, spill_*, ...}
    cubin: bytes = b""  # the binary, when asked for (keep_cubin=True)


def _wheel_dirs() -> list:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return list(spec.submodule_search_locations)


def _loaded_by_cupy() -> list:
    """libnvrtc files mapped into this process once CuPy's NVRTC binding is loaded."""
    if "cupy" not in sys.modules:
        return []
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "libnvrtc.so" in ln})
    except Exception:  # not Linux, or no NVRTC in CuPy
        return []


def _candidates() -> list:
    names = ("libnvrtc.so*", "nvrtc64_*.dll")
    found = []
    env = os.environ.get("RINGMPI_NVRTC")
    if env:
        found.append(env)
    for base in _wheel_dirs():
        for sub in ("cuda_nvrtc/lib", "cu13/lib", "cu12/lib", "cuda_nvrtc/bin", "cu13/bin"):
            for pat in names:
                found += sorted(glob.glob(os.path.join(base, sub, pat)), reverse=True)
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    roots += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "bin"):
            for pat in names:
                found += sorted(glob.glob(os.path.join(root, sub, pat)), reverse=True)
    lib = ctypes.util.find_library("nvrtc")
    if lib:
        found.append(lib)
    found += _loaded_by_cupy()
    # the builtins and "alt" variants are not the API library
    return [f for f in found if "builtins" not in f and ".alt." not in f]


def find_library() -> str:
    """Path of a loadable libnvrtc; raises NvrtcError naming every place tried."""
    tried = _candidates()
    for path in tried:
        try:
            ctypes.CDLL(path)
        except OSError:
            continue
        return path
    raise NvrtcError(
        "libnvrtc not found (install the 'test' extra, e.g. pip install nvidia-cuda-nvrtc-cu12, "
        f"or set RINGMPI_NVRTC); tried: {tried or 'nothing found'}"
    )


def preload_builtins(libnvrtc: str) -> Optional[str]:
    """Load ``libnvrtc-builtins`` from the directory of ``libnvrtc``; its path, or None.

    The builtins matching the library's version come first (``libnvrtc.so.13`` ->
    ``libnvrtc-builtins.so.13.*``); ``.alt`` variants are skipped. None when the
    directory holds none (a system CUDA, where the loader finds them).
    """
    real = os.path.realpath(libnvrtc)
    folder = os.path.dirname(real)
    if not os.path.isabs(libnvrtc) or not os.path.isdir(folder):
        return None
    major = re.search(r"\.so\.(\d+)", os.path.basename(real))
    pats = [f"libnvrtc-builtins.so.{major.group(1)}*"] if major else []
    pats.append("libnvrtc-builtins.so*")
    mode = getattr(os, "RTLD_GLOBAL", 0)
    for pat in pats:
        for path in sorted(glob.glob(os.path.join(folder, pat)), reverse=True):
            if ".alt." in path:
                continue
            try:
                ctypes.CDLL(path, mode=mode)
            except OSError:
                continue
            return path
    return None


_LIB = None
BUILTINS: Optional[str] = None  # the builtins preloaded beside libnvrtc (diagnostics)


def _lib():
    global _LIB, BUILTINS
    if _LIB is None:
        path = find_library()
        BUILTINS = preload_builtins(path)
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_GLOBAL", 0))
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _LIB = lib
    return _LIB


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = _lib().nvrtcGetErrorString(rc).decode()
        raise NvrtcError(f"{what} failed: {msg} ({rc})")


def version() -> tuple:
    """(major, minor) of the loaded NVRTC."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_lib().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


_RE_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_RE_SPILL = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
# what parse_ptxas reports: part of a kept verdict's key (a verdict kept before holds less)
_RESOURCES = "registers stack spill_stores spill_loads smem"


def parse_ptxas(log: str) -> dict:
    """Per-function resources from a ``ptxas -v`` log: registers, stack, spills, smem.

    ``smem`` is the static shared memory in bytes (the ``__shared__`` arrays): a
    launch may use at most the device's opt-in limit minus it dynamically.
    """
    out, cur = {}, None
    for line in log.splitlines():
        m = _RE_FUNC.search(line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = _RE_SPILL.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)))
            cur["spill_loads"] = int(m.group(3))
        m = _RE_REGS.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            m = _RE_SMEM.search(line)
            cur["smem"] = int(m.group(1)) if m else 0
    return out


def compile_source(
    code: str,
    name_expressions: Sequence[str],
    arch: str = "sm_90",
    options: Sequence[str] = OPTIONS,
    filename: str = "kernel.cu",
    verbose_ptxas: bool = True,
    keep_cubin: bool = False,
) -> CompileResult:
    """Compile ``code`` for ``arch`` (e.g. "sm_90") to a cubin through NVRTC.

    Every name expression is registered, so each template instantiation is
    compiled; ``lowered`` maps the expressions NVRTC resolved to mangled names.
    ``ok`` is False on any compile error (the log says why).
    """
    lib = _lib()
    prog = ctypes.c_void_p()
    _check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), filename.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            _check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [*options, f"--gpu-architecture={arch}"]
        if verbose_ptxas:
            opts.append("--ptxas-options=-v")
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.value.decode(errors="replace")
        if rc != 0:
            return CompileResult(arch, False, log)
        lowered = {}
        for expr in name_expressions:
            ptr = ctypes.c_char_p()
            if lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(ptr)) == 0 and ptr.value:
                lowered[expr] = ptr.value.decode()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = b""
        if keep_cubin:
            buf = ctypes.create_string_buffer(size.value)
            _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            cubin = buf.raw
        return CompileResult(arch, True, log, lowered, size.value, parse_ptxas(log), cubin)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def sources() -> dict:
    """{kernel file(s): name expressions} of every CUDA module the GPU tiles load."""
    return {FORWARD_FILE: configs.forward_names(), BACKWARD_FILES: configs.backward_names()}


def _compile_job(job: tuple) -> CompileResult:
    """One (arch, file) program: the verdict kept for this exact input, else a compile."""
    from . import verdicts

    arch, files, names = job
    name = files if isinstance(files, str) else "+".join(files)
    code = source(files)
    ver = ".".join(map(str, version()))
    digest = verdicts.key("nvrtc", ver, code, OPTIONS, arch, names, name, _RESOURCES)
    kept = verdicts.load(digest)
    if kept is not None:
        try:
            return CompileResult(**kept)
        except TypeError:  # another layout: compile
            pass
    res = compile_source(code, names, arch, filename=name)
    if res.ok:
        verdicts.store(digest, {k: v for k, v in vars(res).items() if k != "cubin"})
    return res


def _merge(arch: str, parts: list) -> CompileResult:
    out = CompileResult(arch, all(p.ok for p in parts), "\n".join(p.log for p in parts if p.log))
    for p in parts:
        out.lowered.update(p.lowered)
        out.resources.update(p.resources)
        out.binary_size += p.binary_size
    return out


def check(archs: Sequence[str] = ARCHS, files: Optional[dict] = None) -> dict:
    """Compile every kernel instantiation of every source for each arch; {arch: CompileResult}.

    ``files`` maps kernel file -> name expressions (default :func:`sources`). The
    (arch, file) programs compile concurrently in threads (NVRTC calls release
    the GIL), and the results of one arch are merged into one CompileResult. A
    program whose exact input passed before is not compiled again: its verdict is
    read back (:mod:`ringmpi.gpu.verdicts`).
    """
    from concurrent.futures import ThreadPoolExecutor

    files = sources() if files is None else files
    jobs = [(a, f, tuple(n)) for a in archs for f, n in files.items()]
    _lib()  # load once before the threads start
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        done = list(pool.map(_compile_job, jobs))
    return {a: _merge(a, [r for (ja, _, _), r in zip(jobs, done) if ja == a]) for a in archs}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print NVRTC's verdict and per-kernel registers/spills; exit 1 on a compile error."""
    archs = tuple(argv) if argv else ARCHS
    ver = ".".join(map(str, version()))
    print(f"libnvrtc: {find_library()} (version {ver}); builtins: {BUILTINS or 'system loader'}")
    status = 0
    for arch, res in check(archs).items():
        print(f"{arch}: {'ok' if res.ok else 'FAILED'}, {len(res.lowered)} kernels")
        if not res.ok:
            print(res.log)
            status = 1
        for expr, mangled in res.lowered.items():
            r = res.resources.get(mangled, {})
            print(
                f"  {expr:45s} regs {r.get('registers', '?'):>3}  "
                f"spill st/ld {r.get('spill_stores', '?')}/{r.get('spill_loads', '?')} B  "
                f"stack {r.get('stack', '?')} B  static smem {r.get('smem', '?')} B"
            )
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
