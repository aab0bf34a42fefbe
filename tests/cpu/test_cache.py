"""The kernel cache loads only what this user built (issue 22, item 1), single-user part.

The attacks by a second user (a cache directory or library of another owner) run in
``make test-security`` (tests/security/); here the same checks are driven by the
user's own hand: a group-writable directory, a library replaced after its build, a
symlink in place of the library or of its lock, a lock held for too long.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringmpi.cpu import build
from ringmpi.cpu import cache as kernel_cache
from ringmpi.cpu import isa as cpu_isa
from ringmpi.runtime.files import UnsafePathError

ROOT = Path(__file__).resolve().parents[2]
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler"
)
ISA = cpu_isa.host_isas()[-1]  # scalar: the quickest build

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANT_MARK"), "w");
    if (f) { fputs("ran\n", f); fclose(f); }
}
int answer(void) { return 666; }
"""


def _kernel_dir(tmp_path: Path) -> Path:
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "answer.c").write_text("int answer(void) { return 42; }\n")
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGMPI_KERNEL_DIR", str(_kernel_dir(tmp_path)))
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PLANT_MARK", str(tmp_path / "planted-ran"))
    return tmp_path / "cache"


def _planted_so(tmp_path: Path) -> Path:
    src = tmp_path / "planted.c"
    src.write_text(PLANTED)
    out = tmp_path / "planted.so"
    subprocess.run([build._compiler(), "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


@needs_compiler
def test_new_cache_dir_is_private_under_a_loose_umask(cache):
    old = os.umask(0o002)
    try:
        path = build.build_library("answer.c", ISA)
    finally:
        os.umask(old)
    assert (cache.stat().st_mode & 0o777) == 0o700
    assert (path.stat().st_mode & 0o022) == 0, oct(path.stat().st_mode)
    assert ctypes.CDLL(str(path)).answer() == 42


@needs_compiler
def test_group_writable_cache_dir_is_refused(cache):
    cache.mkdir(mode=0o700)
    cache.chmod(0o775)
    with pytest.raises(UnsafePathError, match="writable by group or others.*RINGMPI_CACHE_DIR"):
        build.build_library("answer.c", ISA)
    assert list(cache.iterdir()) == []  # nothing built into it


@needs_compiler
def test_group_writable_cache_falls_back_to_the_numpy_tile(tmp_path):
    """The fused tile refuses the cache with one warning and the job still runs (numpy tile)."""
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    env = dict(os.environ, RINGMPI_CACHE_DIR=str(cache))
    code = (
        "from ringmpi.cpu import fused\n"
        "assert not fused.available()\n"
        "print(fused.unavailable_reason())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "writable by group or others" in proc.stdout
    assert list(cache.iterdir()) == []


@needs_compiler
def test_replaced_library_is_rebuilt_not_loaded(cache, tmp_path):
    """A file put under the library's name after the build never runs: its hash differs."""
    path = build.build_library("answer.c", ISA)
    planted = _planted_so(tmp_path)
    os.replace(planted, path)
    path.chmod(0o700)
    again = build.build_library("answer.c", ISA)
    assert again == path
    assert ctypes.CDLL(str(again)).answer() == 42
    assert not (tmp_path / "planted-ran").exists()


@needs_compiler
def test_library_without_a_recorded_hash_is_rebuilt(cache, tmp_path):
    """A library whose build recorded nothing (an older cache, a planted pair) is rebuilt."""
    path = build.build_library("answer.c", ISA)
    lock = path.with_name(path.name + ".lock")
    lock.write_text("")
    shutil.copyfile(_planted_so(tmp_path), path)
    assert ctypes.CDLL(str(build.build_library("answer.c", ISA))).answer() == 42
    assert not (tmp_path / "planted-ran").exists()
    assert len(lock.read_text().split()[0]) == 64


@needs_compiler
def test_symlinked_library_is_replaced_not_followed(cache, tmp_path):
    path = build.build_library("answer.c", ISA)
    planted = _planted_so(tmp_path)
    path.unlink()
    path.symlink_to(planted)
    again = build.build_library("answer.c", ISA)
    assert not again.is_symlink()
    assert ctypes.CDLL(str(again)).answer() == 42
    assert not (tmp_path / "planted-ran").exists()
    assert planted.read_bytes().startswith(b"\x7fELF")  # the symlink's target is untouched


@needs_compiler
def test_symlinked_lock_is_refused_and_its_target_untouched(cache, tmp_path):
    path = build.build_library("answer.c", ISA)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = path.with_name(path.name + ".lock")
    lock.unlink()
    lock.symlink_to(victim)
    path.unlink()
    with pytest.raises(UnsafePathError, match="symlink"):
        build.build_library("answer.c", ISA)
    assert victim.read_text() == "precious\n"


@needs_compiler
def test_lock_wait_is_bounded_with_a_message(cache, monkeypatch):
    path = build.build_library("answer.c", ISA)
    path.unlink()  # the next call must build, so it needs the lock
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    monkeypatch.setenv("RINGMPI_BUILD_LOCK_S", "0.5")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still locked by another build.*BUILD_LOCK_S"):
            build.build_library("answer.c", ISA)
        assert time.monotonic() - t0 < 5
    finally:
        os.close(fd)


@pytest.mark.parametrize("val", ["nan", "inf", "-1", "0", "soon"])
def test_lock_wait_setting_is_validated(monkeypatch, val):
    monkeypatch.setenv("RINGMPI_BUILD_LOCK_S", val)
    with pytest.raises(ValueError, match="RINGMPI_BUILD_LOCK_S"):
        kernel_cache.lock_wait_s()


# -- the load sees the file the hash check saw (/proc/self/fd) ----------------------------------


def _swap_after_hashing(monkeypatch, path: Path, planted: Path) -> list:
    """Make the next hash of ``path`` swap ``planted`` in under its name once it is computed."""
    real, swapped = kernel_cache.sha256_fd, []

    def hash_then_swap(fd):
        digest = real(fd)
        if not swapped:
            os.replace(planted, path)
            path.chmod(0o700)
            swapped.append(True)
        return digest

    monkeypatch.setattr(kernel_cache, "sha256_fd", hash_then_swap)
    return swapped


@needs_compiler
def test_library_swapped_after_hashing_is_not_what_loads(cache, tmp_path, monkeypatch):
    path = build.build_library("answer.c", ISA)
    swapped = _swap_after_hashing(monkeypatch, path, _planted_so(tmp_path))
    lib = kernel_cache.load_verified(path)
    assert swapped, "the swap never happened"
    assert lib.answer() == 42  # the verified build, though the name now holds the planted one
    assert lib._name.startswith("/proc/self/fd/")
    assert not (tmp_path / "planted-ran").exists()
    with pytest.raises(UnsafePathError, match="SHA-256 differs"):
        kernel_cache.load_verified(path)  # what is under the name now is refused


@needs_compiler
def test_without_proc_fd_the_checked_path_is_loaded(cache, tmp_path, monkeypatch):
    """Elsewhere (no /proc/self/fd) the path is loaded: the same swap then wins, which is
    why Linux loads through the descriptor."""
    path = build.build_library("answer.c", ISA)
    monkeypatch.setattr(kernel_cache, "fd_path", lambda fd: None)
    _swap_after_hashing(monkeypatch, path, _planted_so(tmp_path))
    assert kernel_cache.load_verified(path).answer() == 666
    assert (tmp_path / "planted-ran").read_text() == "ran\n"


@needs_compiler
def test_libraries_loaded_in_turn_are_each_their_own(cache, tmp_path, monkeypatch):
    """The loader knows a library by its name: /proc/self/fd/N must never be reused."""
    kdir = Path(os.environ["RINGMPI_KERNEL_DIR"])
    got = []
    for i, value in enumerate((42, 7, 1234)):
        (kdir / f"n{i}.c").write_text(f"int answer(void) {{ return {value}; }}\n")
        got.append(kernel_cache.load_verified(build.build_library(f"n{i}.c", ISA)).answer())
    assert got == [42, 7, 1234]


@needs_compiler
def test_fused_kernels_load_through_the_descriptor():
    """The tiles' libraries (forward and backward) come through load_verified, paths kept."""
    from ringmpi.cpu import fused, fused_backward

    kern = fused.load(ISA)
    assert kern._lib._name.startswith("/proc/self/fd/")
    assert str(kern.path).endswith(".so") and kern.path.is_file()
    lib = fused_backward.open_library(build.build_library("cpu_backward.c", ISA))
    assert lib._name.startswith("/proc/self/fd/")
    assert int(lib.rm_backward_simd_width_bytes()) == (0 if ISA == "scalar" else 32)


@needs_compiler
def test_a_changed_header_changes_the_key(cache):
    """A header the source includes is hashed into the key: editing it gives a new build."""
    kdir = Path(os.environ["RINGMPI_KERNEL_DIR"])
    (kdir / "hdr.c").write_text('#include "hdr.h"\nint answer(void) { return ANSWER; }\n')
    (kdir / "hdr.h").write_text('#include "hdr_inner.h"\n#define ANSWER (INNER + 1)\n')
    (kdir / "hdr_inner.h").write_text("#define INNER 41\n")
    first = build.build_library("hdr.c", ISA)
    assert kernel_cache.load_verified(first).answer() == 42
    assert build.build_library("hdr.c", ISA) == first  # unchanged sources: the cached build
    (kdir / "hdr_inner.h").write_text("#define INNER 6\n")  # a header of a header
    second = build.build_library("hdr.c", ISA)
    assert second != first
    assert kernel_cache.load_verified(second).answer() == 7
    # the compiler read private copies, which are gone: only libraries and locks remain
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [first.name, first.name + ".lock", second.name, second.name + ".lock"]
    )


def test_kernel_headers_come_from_the_source_directory(cache):
    kdir = Path(os.environ["RINGMPI_KERNEL_DIR"])
    (kdir / "up.c").write_text('#include "../up.h"\nint answer(void) { return 1; }\n')
    with pytest.raises(ValueError, match=r'#include "\.\./up\.h".*without a directory'):
        build.build_library("up.c", ISA)
    (kdir / "gone.c").write_text('#include "gone.h"\nint answer(void) { return 1; }\n')
    with pytest.raises(FileNotFoundError, match="included header gone.h not found in"):
        build.build_library("gone.c", ISA)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_the_fused_kernels_hash_their_shared_headers():
    """Both fused kernels include the shared SIMD layer, and it is part of their keys."""
    for source in ("cpu_tile.c", "cpu_backward.c"):
        names = list(build.kernel_sources(source))
        assert names[0] == source
        assert {"cpu_simd.h", "cpu_blocks.h", "cpu_simd_type.h"} <= set(names[1:]), names
