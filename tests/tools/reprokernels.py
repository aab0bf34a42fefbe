"""Shared checks of the reproducible mode's C kernels (tests/cpu/test_fused_reproducible*.py).

``isa_objects`` compiles a kernel for every x86 ISA path (the ones the host cannot run too)
with the kernel's own flags and returns each build's disassembly; ``fma_instructions``
lists the fused multiply-adds in one; ``flags_keep_the_bits`` checks that $RINGMPI_CFLAGS
cannot change a kernel's bits. ``by_every_path`` runs one forward call by the numpy
oracle and by both forward kernels (the float64 method's and the float32 method's) built
for every ISA path the host executes, and checks that every result has the numpy bits.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from mpi4py import MPI

import ringmpi
from ringmpi.cpu import build, fused_reproducible, fused_reproducible_float32
from ringmpi.cpu.isa import host_isas, is_x86
from ringmpi.cpu.loader import Loader
from ringmpi.runtime.kernel_files import kernel_path
from tools.fingerprint import digest

FLAGS = {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"], "scalar": []}


def isa_objects(source: str, tmp_path) -> dict:
    """{isa: objdump -d text, or None without objdump} of ``kernels/<source>`` per path.

    Skips the test off x86 or where the compiler does not know an ISA level; a failed
    compile is an assertion error with the compiler's message.
    """
    if not is_x86():
        pytest.skip("the ISA paths are x86's")
    src = kernel_path(source)
    cc = build._compiler()
    out = {}
    for isa, extra in FLAGS.items():
        obj = tmp_path / f"{isa}.o"
        cmd = [cc, "-O3", *extra, "-ffp-contract=off", "-fno-fast-math", "-c", str(src),
               "-o", str(obj)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode and "x86-64-v" in proc.stderr:
            pytest.skip(f"{cc} does not know {extra}")
        assert proc.returncode == 0, f"{isa}: {proc.stderr[-2000:]}"
        try:
            dis = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True)
            out[isa] = dis.stdout
        except FileNotFoundError:
            out[isa] = None
    return out


def fma_instructions(dis: str) -> list:
    """The fused multiply-add mnemonics in a disassembly (vfmadd231pd, vfnmsub213ss, ...)."""
    return re.findall(r"\bvf(?:n?m(?:add|sub)|maddsub|msubadd)\w*", dis)


def call(q, k, v, kw):
    return ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, return_lse=True, reproducible=True, **kw)


def by_every_path(q, k, v, kw, monkeypatch) -> dict:
    """{"numpy": (out, lse), "<isa>": (out, lse), ...} of the same reproducible call, each
    with the numpy code's bits (an assertion naming the paths that differ)."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    got = {"numpy": call(q, k, v, kw)}
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")
    for isa in host_isas():  # float32 inputs run the float32 method's kernel (its loader)
        with fused_reproducible.LOADER.pinned(isa), fused_reproducible_float32.LOADER.pinned(isa):
            got[isa] = call(q, k, v, kw)
    want = digest(*got["numpy"])
    bad = [name for name, res in got.items() if digest(*res) != want]
    assert not bad, f"{kw}: {bad} differ from the numpy code"
    return got


def flags_keep_the_bits(module, kernel_class, q, k, v, kw, monkeypatch, tmp_path) -> None:
    """$RINGMPI_CFLAGS with -ffast-math and FMA contraction: a fresh build of ``module``'s
    kernel (a private cache) gives the bits of the cached one and of the numpy code (the
    kernel's own flags come after the environment's and win)."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")
    want = digest(*call(q, k, v, kw))
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RINGMPI_CFLAGS", "-ffast-math -ffp-contract=fast")
    fresh = Loader(kernel_class, "reproducible kernel (test build)", warn=False)
    monkeypatch.setattr(module, "LOADER", fresh)
    assert digest(*call(q, k, v, kw)) == want
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    assert digest(*call(q, k, v, kw)) == want
