"""Compile every kernel instantiation with the CUDA toolkit's nvcc (``-ptx``), warnings as errors.

A second compiler beside NVRTC (:mod:`ringmpi.gpu.nvrtc`): each kernel module's text,
exactly as the loader hands it to NVRTC (:func:`ringmpi.gpu.sources.source`, the
header spliced in), gets one line that takes the address of every template
instantiation the GPU tiles may launch (so nvcc compiles each one), and is compiled
with ``nvcc -arch=<arch> -ptx -Werror all-warnings``: nvcc's front end and NVVM see every
instantiation. The step after PTX (ptxas: registers, spills, shared memory) is the NVRTC
check's, which builds cubins for each arch; the host side is never built (the loader
only ever launches the kernels through NVRTC), so ``-c`` would add ptxas and gcc for
nothing (it took 2.7x as long as ``-ptx`` on the forward module here). Needs nvcc
(``$NVCC``, ``PATH``, ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda*``), no GPU. ``python -m
ringmpi.gpu.nvcc [sm_90 ...]`` prints the verdict per module; exit 1 on an error or a
warning. A passing verdict is kept for its exact input (:mod:`ringmpi.gpu.verdicts`).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Optional

from . import verdicts
from .nvrtc import sources
from .sources import OPTIONS, source

__all__ = ["find_nvcc", "instantiations", "compile_module", "check"]

ARCHS = ("sm_90",)


def find_nvcc() -> Optional[str]:
    """Path of an nvcc executable, or None."""
    cands = [os.environ.get("NVCC"), shutil.which("nvcc")]
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    roots += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    cands += [os.path.join(r, "bin", "nvcc") for r in roots if r]
    return next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def instantiations(names: Sequence[str]) -> str:
    """Host code that takes the address of each kernel ``names`` lists (instantiating it)."""
    body = ",\n  ".join(f"(const void*)&{n}" for n in names)
    return f"\nconst void* ringmpi_nvcc_instances[] = {{\n  {body}\n}};\n"


def compile_module(files, names: Sequence[str], arch: str, nvcc: str, timeout: int = 1200):
    """(ok, compiler output) of one module compiled with nvcc for ``arch``; no warning allowed.

    Parameters
    ----------
    files : str or tuple of str
        The kernel file(s) of the module (as :func:`ringmpi.gpu.sources.source` takes).
    names : sequence of str
        Its template instantiations (NVRTC name expressions).
    arch : str
        e.g. ``"sm_90"``.
    nvcc : str
        The nvcc executable.
    """
    text = source(files) + instantiations(names)
    digest = verdicts.key("nvcc", _identity(nvcc), text, OPTIONS, arch, "-ptx")
    if verdicts.load(digest) is not None:
        return True, ""
    with tempfile.TemporaryDirectory(prefix="ringmpi_nvcc.") as tmp:
        src = os.path.join(tmp, "module.cu")
        with open(src, "x") as f:  # a fresh private directory: O_EXCL
            f.write(text)
        cmd = [
            nvcc,
            *OPTIONS,
            f"-arch={arch}",
            "-ptx",
            "-Werror",
            "all-warnings",
            src,
            "-o",
            os.path.join(tmp, "module.ptx"),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = (res.stdout + res.stderr).strip()
        ok = res.returncode == 0 and not out
        if ok:
            verdicts.store(digest, {"arch": arch})
        return ok, out


def _identity(nvcc: str) -> str:
    """The compiler a verdict depends on: its real path and ``nvcc --version``."""
    res = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return f"{os.path.realpath(nvcc)}\n{res.stdout}"


def check(archs: Sequence[str] = ARCHS) -> dict:
    """{(arch, module): (ok, output)} over every kernel module; RuntimeError without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set NVCC or CUDA_HOME, or put it on PATH)")
    out = {}
    for arch in archs:
        for files, names in sources().items():
            out[(arch, files)] = compile_module(files, names, arch, nvcc)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print nvcc's verdict per (arch, module); 1 on any error or warning."""
    status = 0
    for (arch, files), (ok, log) in check(tuple(argv) if argv else ARCHS).items():
        print(f"{arch} {files}: {'ok (no warnings)' if ok else 'FAILED'}")
        if not ok:
            print(log)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
