"""ringmpi.gpu.verdicts: the compile checks reuse a passing verdict only for the same input.

A verdict is kept under the SHA-256 of everything that decides it; a change of any part
is a new key (a compile), failures are never kept, and only this user's private files
are read back.
"""

from __future__ import annotations

import json
import os

import pytest

from ringmpi.gpu import nvcc, nvrtc, verdicts

SKIP_NVRTC = os.environ.get("RINGMPI_SKIP_NVRTC") == "1"
TINY = "template <int N> __global__ void k(float *x) { x[threadIdx.x] *= N; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(d))
    monkeypatch.delenv("RINGMPI_CHECK_CACHE", raising=False)
    return d / "checks"


def test_key_depends_on_every_part_and_its_boundaries():
    base = verdicts.key("nvrtc", "13.0", "code", ("-O3",), "sm_90", ("k<1>",))
    assert base == verdicts.key("nvrtc", "13.0", "code", ("-O3",), "sm_90", ("k<1>",))
    others = [
        verdicts.key("nvrtc", "13.1", "code", ("-O3",), "sm_90", ("k<1>",)),
        verdicts.key("nvrtc", "13.0", "code ", ("-O3",), "sm_90", ("k<1>",)),
        verdicts.key("nvrtc", "13.0", "code", ("-O2",), "sm_90", ("k<1>",)),
        verdicts.key("nvrtc", "13.0", "code", ("-O3",), "sm_80", ("k<1>",)),
        verdicts.key("nvrtc", "13.0", "code", ("-O3",), "sm_90", ("k<2>",)),
        verdicts.key("nvrtc", "13.0", "code", ("-O3", "sm_90"), ("k<1>",)),  # moved boundary
    ]
    assert base not in others and len(set(others)) == len(others)


def test_store_and_load_round_trip_private_only(cache, monkeypatch):
    d = verdicts.key("x")
    assert verdicts.load(d) is None
    verdicts.store(d, {"ok": True, "n": 3})
    assert verdicts.load(d) == {"ok": True, "n": 3}
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    assert (cache / f"{d}.json").stat().st_mode & 0o077 == 0
    monkeypatch.setenv("RINGMPI_CHECK_CACHE", "0")
    assert verdicts.load(d) is None
    monkeypatch.delenv("RINGMPI_CHECK_CACHE")
    os.chmod(cache, 0o770)  # group-writable: not trusted
    assert verdicts.load(d) is None
    os.chmod(cache, 0o700)
    other = verdicts.key("y")
    (cache / f"{other}.json").symlink_to(cache / f"{d}.json")  # a planted link
    assert verdicts.load(other) is None
    (cache / f"{d}.json").write_text(json.dumps({"key": d, "ok": True, "value": [1]}))
    assert verdicts.load(d) is None  # malformed
    (cache / f"{d}.json").write_text(json.dumps({"key": other, "ok": True, "value": {}}))
    assert verdicts.load(d) is None  # a verdict of another key


@pytest.mark.skipif(SKIP_NVRTC, reason="RINGMPI_SKIP_NVRTC=1: NVRTC check skipped")
def test_nvrtc_check_compiles_once_per_input(cache, monkeypatch):
    code = {"v": TINY}
    monkeypatch.setattr(nvrtc, "source", lambda files: code["v"])
    calls = []
    real = nvrtc.compile_source

    def counting(*a, **kw):
        calls.append(a[2])
        return real(*a, **kw)

    monkeypatch.setattr(nvrtc, "compile_source", counting)
    files = {"tiny.cu": ("k<1>", "k<2>")}
    first = nvrtc.check(("sm_80",), files)["sm_80"]
    assert first.ok and set(first.lowered) == {"k<1>", "k<2>"} and calls == ["sm_80"]
    again = nvrtc.check(("sm_80",), files)["sm_80"]
    assert calls == ["sm_80"], "an unchanged input compiled again"
    assert (again.ok, again.lowered, again.resources) == (first.ok, first.lowered, first.resources)
    code["v"] = TINY.replace("*= N", "+= N")
    assert nvrtc.check(("sm_80",), files)["sm_80"].ok and calls == ["sm_80"] * 2
    code["v"] = "__global__ void k() { undefined_thing(); }"
    for _ in range(2):  # a failure is compiled (and reported) every time
        assert not nvrtc.check(("sm_80",), {"bad.cu": ()})["sm_80"].ok
    assert calls == ["sm_80"] * 4


@pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc")
def test_nvcc_check_compiles_once_per_input(cache, monkeypatch):
    code = {"v": TINY}
    monkeypatch.setattr(nvcc, "source", lambda files: code["v"])
    runs = []
    real = nvcc.subprocess.run

    def counting(cmd, *a, **kw):
        runs.append("-ptx" in cmd)
        return real(cmd, *a, **kw)

    monkeypatch.setattr(nvcc.subprocess, "run", counting)
    exe = nvcc.find_nvcc()
    assert nvcc.compile_module("tiny.cu", ("k<1>",), "sm_90", exe) == (True, "")
    assert nvcc.compile_module("tiny.cu", ("k<1>",), "sm_90", exe) == (True, "")
    assert runs.count(True) == 1, runs
    assert nvcc.compile_module("tiny.cu", ("k<2>",), "sm_90", exe) == (True, "")
    assert runs.count(True) == 2, runs
    code["v"] = TINY + "__global__ void w() { int unused; }\n"  # a warning: not kept
    for _ in range(2):
        ok, log = nvcc.compile_module("tiny.cu", ("k<1>",), "sm_90", exe)
        assert not ok and log
    assert runs.count(True) == 4, runs
