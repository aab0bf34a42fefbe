"""Choosing, refusing and building the fused kernel's ISA paths; one compile per cache file."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringmpi.cpu import build, fused
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu.loader import Loader
from ringmpi.softmax import init_state

ROOT = Path(__file__).resolve().parents[2]

needs_compiler = pytest.mark.skipif(
    not fused.available(), reason=f"fused kernel unavailable: {fused.unavailable_reason()}"
)


@pytest.fixture
def fresh_default(monkeypatch):
    """Forget the default kernel (restored afterwards) so the next call reads the environment."""
    monkeypatch.setattr(fused, "LOADER", Loader(fused.Kernel, "fused CPU tile"))


def _fake_cpu(monkeypatch, *flags):
    monkeypatch.setattr(cpu_isa, "host_features", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)


def test_host_isas_follow_cpu_features(monkeypatch):
    _fake_cpu(monkeypatch, "sse2", "avx", "avx2", "fma", "avx512f")
    assert cpu_isa.host_isas() == ("avx512", "avx2", "scalar")
    _fake_cpu(monkeypatch, "sse2", "avx", "avx2", "fma")
    assert cpu_isa.host_isas() == ("avx2", "scalar")
    assert build.resolve_isa("auto") == "avx2"
    _fake_cpu(monkeypatch, "sse2", "avx", "avx2")  # AVX2 without FMA: the kernel needs both
    assert cpu_isa.host_isas() == ("scalar",)
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: False)
    assert cpu_isa.host_isas() == ("scalar",)


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="unknown CPU ISA path 'sse9'.*auto, avx512, avx2, scalar"):
        fused.load("sse9")
    with pytest.raises(ValueError, match="unknown CPU ISA path"):
        build.build_library("cpu_tile.c", "neon")


def test_path_the_host_cannot_run_is_refused(monkeypatch):
    _fake_cpu(monkeypatch, "sse2", "avx", "avx2", "fma")
    with pytest.raises(ValueError, match="'avx512' cannot run on this host: it lacks avx512f"):
        fused.load("avx512")
    _fake_cpu(monkeypatch, "sse2")
    with pytest.raises(ValueError, match="'avx2' cannot run.*lacks avx2, fma.*can run scalar"):
        build.build_library("cpu_tile.c", "avx2")


def test_bad_environment_raises_instead_of_falling_back(monkeypatch, fresh_default):
    monkeypatch.setenv("RINGMPI_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="RINGMPI_CPU_ISA"):
        fused.available()
    _fake_cpu(monkeypatch, "sse2", "avx", "avx2", "fma")
    monkeypatch.setenv("RINGMPI_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="cannot run on this host"):
        fused.forward_tile(*([None] * 8), scale=1.0, causal=False)


@needs_compiler
@pytest.mark.parametrize("isa", cpu_isa.host_isas())
def test_environment_picks_the_default_path(monkeypatch, fresh_default, isa):
    """RINGMPI_CPU_ISA selects what forward_tile/finalize run; results equal load(isa)'s."""
    monkeypatch.setenv("RINGMPI_CPU_ISA", isa.upper())
    assert fused.isa() == isa and fused.available()
    assert fused.simd_width() == fused.load(isa).simd_width
    assert fused.library_path() == fused.load(isa).path
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 50, 24)).astype(np.float32) for _ in range(3))
    pos = np.arange(50, dtype=np.int64)
    s1, s2 = init_state(q.shape, np.float32), init_state(q.shape, np.float32)
    fused.forward_tile(q, k, v, pos, pos, *s1, scale=0.2, causal=True)
    fused.load(isa).forward_tile(q, k, v, pos, pos, *s2, scale=0.2, causal=True)
    for a, b in zip(s1, s2):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fused.finalize(*s1), fused.load(isa).finalize(*s2)):
        np.testing.assert_array_equal(a, b)


@needs_compiler
@pytest.mark.skipif(len(cpu_isa.host_isas()) < 2, reason="the host runs only the scalar path")
def test_auto_falls_back_to_a_narrower_path(monkeypatch, fresh_default, capsys):
    """auto: when the widest path fails to build, the next one is used, with one line."""
    widest, nxt = cpu_isa.host_isas()[:2]
    real = fused.LOADER.load

    def load(isa=None):
        if build.resolve_isa(isa) == widest:
            raise RuntimeError("compiler too old\nmore detail")
        return real(isa)

    monkeypatch.setattr(fused.LOADER, "load", load)
    monkeypatch.setenv("RINGMPI_CPU_ISA", "auto")
    assert fused.isa() == nxt and fused.available() and fused.unavailable_reason() is None
    err = capsys.readouterr().err
    want = f"{widest} path failed, using {nxt} (RuntimeError: compiler too old)"
    assert err == f"ringmpi: fused CPU tile: {want}\n"
    # an explicit path does not fall back
    fused.LOADER.forget()
    monkeypatch.setenv("RINGMPI_CPU_ISA", widest)
    assert not fused.available() and "compiler too old" in fused.unavailable_reason()
    assert "using the numpy tile" in capsys.readouterr().err


@needs_compiler
def test_auto_is_the_widest_path():
    assert fused.load("auto").isa == cpu_isa.host_isas()[0]
    assert fused.load(None) is fused.load(os.environ.get("RINGMPI_CPU_ISA", "auto"))


@needs_compiler
def test_build_library_compiles_any_kernel_source(tmp_path, monkeypatch):
    """Another kernels/*.c source: same flags and cache; the ISA macros reach it."""
    src_dir = tmp_path / "kernels"
    src_dir.mkdir()
    (src_dir / "answer.c").write_text(
        "int answer(void) {\n#if defined(__AVX512F__)\n return 512;\n"
        "#elif defined(__AVX2__)\n return 2;\n#else\n return 0;\n#endif\n}\n"
    )
    monkeypatch.setenv("RINGMPI_KERNEL_DIR", str(src_dir))
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    for isa in cpu_isa.host_isas():
        path = build.build_library("answer.c", isa)
        assert path.parent == tmp_path / "cache" and path.name.startswith(f"answer-{isa}-")
        assert ctypes.CDLL(str(path)).answer() == {"avx512": 512, "avx2": 2, "scalar": 0}[isa]
    with pytest.raises(FileNotFoundError, match="nothere.c not found"):
        build.build_library("nothere.c")


def _logging_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A $CC that appends one line to a log per compile (slowly) and then runs the real one."""
    real = build._compiler()
    log = tmp_path / "compiles.log"
    cc = tmp_path / "logcc"
    cc.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" --version "*) exec ' + real + ' "$@";; esac\n'
        f'echo "$$" >> "{log}"\n'
        "sleep 1\n"
        f'exec {real} "$@"\n'
    )
    cc.chmod(0o755)
    return cc, log


@needs_compiler
def test_one_compile_for_concurrent_builders(tmp_path):
    """Four processes need the same library at once: one compiles, the others wait and load."""
    cc, log = _logging_compiler(tmp_path)
    env = dict(os.environ, CC=str(cc), RINGMPI_CACHE_DIR=str(tmp_path / "cache"))
    isa = cpu_isa.host_isas()[-1]  # scalar: the quickest build
    code = (
        f"from ringmpi.cpu import fused; k = fused.load({isa!r}); "
        "print(k.path); assert k.isa == " + repr(isa)
    )

    def run_all(n):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
            )
            for _ in range(n)
        ]
        outs = [p.communicate(timeout=600)[0].strip() for p in procs]
        assert all(p.returncode == 0 for p in procs)
        return outs

    outs = run_all(4)
    assert len(set(outs)) == 1 and Path(outs[0]).is_file()
    assert len(log.read_text().splitlines()) == 1
    # a ready library is used without compiling
    assert run_all(2) == outs[:2]
    assert len(log.read_text().splitlines()) == 1
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert names == sorted([Path(outs[0]).name, Path(outs[0]).name + ".lock"])


def test_no_compiler_warns_once_and_uses_the_numpy_tile(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "RINGMPI_CPU_ISA")}
    env.update(PATH=str(empty), RINGMPI_CACHE_DIR=str(tmp_path / "cache"))
    # an Open MPI singleton starts its daemon from PATH: keep it off PATH's job here
    env.update(OMPI_MCA_ess_singleton_isolated="1")
    code = """
import numpy as np
from ringmpi.cpu import fused
from ringmpi.cpu import numpy_tile as cpu
from ringmpi.softmax import init_state
assert not fused.available()
assert "no C compiler" in fused.unavailable_reason()
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 30, 8)).astype(np.float32) for _ in range(3))
pos = np.arange(30)
for _ in range(2):
    s1, s2 = init_state(q.shape, np.float32), init_state(q.shape, np.float32)
    fused.forward_tile(q, k, v, pos, pos, *s1, scale=0.3, causal=True)
    cpu.forward_tile(q, k, v, pos, pos, *s2, scale=0.3, causal=True)
    assert all(np.array_equal(a, b) for a, b in zip(s1, s2))
    fused.finalize(*s1)
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert "fused CPU tile unavailable, using the numpy tile" in lines[0]
    assert "no C compiler" in lines[0]


@pytest.mark.mpi
@needs_compiler
def test_ranks_of_a_node_compile_once(monkeypatch):
    """All ranks build the same library at once (under mpiexec): exactly one compile."""
    import tempfile

    from mpi4py import MPI

    from ringmpi.testing import assert_all

    comm = MPI.COMM_WORLD
    tmp = comm.bcast(tempfile.mkdtemp(prefix="ringmpi-isa-") if comm.rank == 0 else None)
    tmp = Path(tmp)
    if comm.rank == 0:
        _logging_compiler(tmp)
    comm.Barrier()
    monkeypatch.setenv("CC", str(tmp / "logcc"))
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp / "cache"))
    path = build.build_library("cpu_tile.c", cpu_isa.host_isas()[-1])
    paths = comm.allgather(str(path))
    comm.Barrier()
    compiles = len((tmp / "compiles.log").read_text().splitlines())
    assert_all(comm, len(set(paths)) == 1 and path.is_file(), f"paths {paths}")
    assert_all(comm, compiles == 1, f"{compiles} compiles")
    comm.Barrier()
    if comm.rank == 0:
        import shutil

        shutil.rmtree(tmp)


def test_cpuinfo_is_read_in_one_place(monkeypatch):
    """host_features and the cache key's cpu_flags come from one reader of /proc/cpuinfo."""
    monkeypatch.setattr(cpu_isa, "_cpuinfo_flags", lambda: "fpu sse2 avx2 fma")
    assert cpu_isa.host_features() == frozenset({"fpu", "sse2", "avx2", "fma"})
    assert cpu_isa.cpu_flags() == "fpu sse2 avx2 fma"
    monkeypatch.setattr(cpu_isa, "_cpuinfo_flags", lambda: None)
    assert cpu_isa.host_features() is None and cpu_isa.cpu_flags()  # the platform's name
    readers = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "ringmpi").rglob("*.py"))
        if 'open("/proc/cpuinfo")' in p.read_text()
    ]
    assert readers == ["ringmpi/cpu/isa.py"], readers


@needs_compiler
def test_both_fused_kernels_load_per_isa_through_one_loader():
    """The forward and backward tiles: one build per ISA path, reporting that path."""
    from ringmpi.cpu import fused_backward

    for isa in cpu_isa.host_isas():
        fwd, bwd = fused.load(isa), fused_backward.LOADER.load(isa)
        assert (fwd.isa, bwd.isa) == (isa, isa)
        assert fwd.simd_width == bwd.simd_width == {"avx512": 64, "avx2": 32, "scalar": 0}[isa]
        assert f"cpu_backward-{isa}-" in bwd.path.name
        assert fused_backward.LOADER.load(isa) is bwd  # memoized


@needs_compiler
def test_pinned_default_is_restored():
    """LOADER.pinned(isa) makes the module-level tiles run that path, then restores the default."""
    from ringmpi.cpu import fused_backward

    before = fused.isa(), fused_backward.simd_width()
    for isa in cpu_isa.host_isas():
        with fused.LOADER.pinned(isa), fused_backward.LOADER.pinned(isa) as bwd:
            assert fused.isa() == isa and fused.library_path() == fused.load(isa).path
            assert fused_backward.library_path() == bwd.path and bwd.isa == isa
        assert (fused.isa(), fused_backward.simd_width()) == before
