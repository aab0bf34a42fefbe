"""The cubin cache and the tune file trust only this user's private files (issue 22, item 2).

NVRTC compiles here without a GPU (as in tests/gpu/test_nvrtc.py); the cubins are
never launched, only looked up.
"""

from __future__ import annotations

import json
import os

import pytest

from ringmpi.gpu import loader, tune
from ringmpi.gpu import tile as gpu
from ringmpi.runtime.files import UnsafePathError

SKIP_NVRTC = os.environ.get("RINGMPI_SKIP_NVRTC") == "1"
needs_nvrtc = pytest.mark.skipif(SKIP_NVRTC, reason="RINGMPI_SKIP_NVRTC=1: NVRTC check skipped")
EXPR = "attn_fwd_simt<float, float, 64, 32, 32>"
OTHER = "attn_fwd_mma<bf16_t, 64>"


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A private cache holding EXPR compiled for sm_80; (code, cubin path, metadata path)."""
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_arch", lambda dev: "sm_80")
    assert loader.precompile(gpu.KERNEL_FILE, (EXPR,), 0) == {EXPR: "compiled"}
    code = loader.source(gpu.KERNEL_FILE)
    cubin, meta = loader._paths(code, EXPR, "sm_80")
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == oct(0o700)
    assert loader._lookup(code, EXPR, "sm_80") == (cubin, json.loads(meta.read_text())["mangled"])
    return code, cubin, meta


@pytest.mark.parametrize(
    "expr, mangled, ok",
    [
        ("attn_fwd_mma<bf16_t, 64>", "_Z12attn_fwd_mmaI6bf16_tLi64EEvv", True),
        ("attn_fwd_mma<bf16_t, 64>", "_Z13attn_fwd_simtIffLi64EEvv", False),
        ("ns::k<int>", "_ZN2ns1kIiEEvv", True),
        ("plain", "plain", True),
        ("plain", "plain; rm -rf", False),
        ("attn_fwd_mma<bf16_t, 64>", None, False),
    ],
)
def test_symbol_must_name_the_expression(expr, mangled, ok):
    assert loader._symbol_ok(expr, mangled) is ok


@needs_nvrtc
def test_metadata_cannot_pick_another_symbol(cached):
    code, cubin, meta = cached
    info = json.loads(meta.read_text())
    info["mangled"] = "_Z13attn_bwd_evilv"
    meta.write_text(json.dumps(info))
    assert loader._lookup(code, EXPR, "sm_80") is None


@needs_nvrtc
def test_replaced_cubin_is_not_loaded(cached):
    code, cubin, meta = cached
    data = bytearray(cubin.read_bytes())
    data[-1] ^= 0xFF
    cubin.write_bytes(bytes(data))
    assert loader._lookup(code, EXPR, "sm_80") is None
    assert loader.precompile(gpu.KERNEL_FILE, (EXPR,), 0) == {EXPR: "compiled"}
    assert loader._lookup(code, EXPR, "sm_80") is not None  # recompiled, verified again


@needs_nvrtc
def test_symlinked_cubin_is_not_followed(cached, tmp_path):
    code, cubin, meta = cached
    elsewhere = tmp_path / "elsewhere.cubin"
    os.replace(cubin, elsewhere)
    cubin.symlink_to(elsewhere)
    assert loader._lookup(code, EXPR, "sm_80") is None


@needs_nvrtc
def test_group_writable_cache_is_refused_and_compiles_privately(cached, tmp_path):
    code, cubin, meta = cached
    cubin.parent.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by group or others"):
        loader._lookup(code, EXPR, "sm_80")
    res = loader.precompile(gpu.KERNEL_FILE, (EXPR,), 0)
    assert "writable by group or others" in res[EXPR]
    private, mangled = loader._compile(code, OTHER, "sm_80")
    assert private.parent != cubin.parent  # kept out of the shared directory
    assert oct(private.stat().st_mode & 0o777) == oct(0o600)
    assert not loader._paths(code, OTHER, "sm_80")[0].exists()
    private.unlink()


def test_tune_file_of_loose_mode_or_symlink_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RINGMPI_TUNE_FILE", raising=False)
    tune.forget()
    assert tune.choose("k", ["a", "b"], lambda n: {"a": 2.0, "b": 1.0}[n]) == "b"
    path = tune.cache_path()
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    tune.forget()
    assert tune.cached("k", ["a", "b"]) == "b"
    planted = json.dumps({"version": 1, "choices": {"k": {"config": "a"}}})
    path.write_text(planted)
    path.chmod(0o666)
    tune.forget()
    assert tune.cached("k", ["a", "b"]) is None
    other = tmp_path / "other.json"
    other.write_text(planted)
    path.unlink()
    path.symlink_to(other)
    tune.forget()
    assert tune.cached("k", ["a", "b"]) is None
    # saving replaces the symlink, never writes through it
    assert tune.choose("k", ["a", "b"], lambda n: {"a": 2.0, "b": 1.0}[n]) == "b"
    assert other.read_text() == planted and not path.is_symlink()
    tune.forget()
