"""The seam between calls and tiles: spec=, Backend.supports/describe, no silent fallback."""

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi import backend
from ringmpi.reference import attention, attention_backward
from ringmpi.spec import AttentionSpec

SELF = MPI.COMM_SELF


def _qkv(n=150, nk=None, h=4, hkv=2, d=16, dtype=np.float32, seed=0):
    """Values shaped like projections: a mean per channel, a small spread."""
    rng = np.random.default_rng(seed)
    nk = n if nk is None else nk
    mean = rng.standard_normal(d)
    q = (mean + 0.2 * rng.standard_normal((n, h, d))).astype(dtype)
    k = (mean + 0.2 * rng.standard_normal((nk, hkv, d))).astype(dtype)
    v = (1.5 + 0.3 * rng.standard_normal((nk, hkv, d))).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("kernel", ["numpy", "fused"])
def test_spec_keyword_equals_the_keywords_and_the_reference(monkeypatch, kernel):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
    cu = np.array([0, 40, 41, 150])
    q, k, v = _qkv(dtype=np.float64)
    kw = dict(causal=True, window=(30, 0), cu_seqlens=cu, layout="striped", scale=0.3)
    spec = AttentionSpec(**kw)
    a, lse_a = ringmpi.ring_attention(q, k, v, SELF, return_lse=True, **kw)
    b, lse_b = ringmpi.ring_attention(q, k, v, SELF, return_lse=True, spec=spec)
    assert a.tobytes() == b.tobytes() and lse_a.tobytes() == lse_b.tobytes()
    ref, ref_lse = attention(q, k, v, True, scale=0.3, window=(30, 0), cu_seqlens=cu)
    np.testing.assert_allclose(b, ref, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse_b, ref_lse, rtol=1e-11, atol=1e-12)
    dout = np.random.default_rng(1).standard_normal(q.shape)
    g1 = ringmpi.ring_attention_backward(dout, q, k, v, b, lse_b, SELF, **kw)
    g2 = ringmpi.ring_attention_backward(dout, q, k, v, b, lse_b, SELF, spec=spec)
    want = attention_backward(dout, q, k, v, True, scale=0.3, window=(30, 0), cu_seqlens=cu)
    for x, y, w in zip(g1, g2, want):
        assert x.tobytes() == y.tobytes()
        np.testing.assert_allclose(y, w, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="either spec= or"):
        ringmpi.ring_attention(q, k, v, SELF, causal=True, spec=spec)


def test_stats_say_which_tiles_ran(monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    q, k, v = _qkv()
    st = {}
    ringmpi.ring_attention(q, k, v, SELF, stats=st)
    assert st["backend"] == "numpy" and st["tile"].startswith("numpy: ")
    assert st["flops"] == 4 * 150 * 150 * 16 * 4 and st["alltoall_bytes"] == 0


def _fused():
    be = backend.select(np.zeros(1, np.float32))
    if be.name != "fused":
        pytest.skip(f"the fused CPU tile is unavailable here ({be.describe()})")
    return be


def test_fused_describe_names_both_passes():
    be = _fused()
    text = be.describe()
    assert "forward: fused C" in text and "backward: fused C" in text, text


def test_fused_tiles_refuse_what_they_would_hand_to_numpy():
    """float16 arrays (or non-contiguous state) raise instead of running the numpy tile."""
    be = _fused()
    q = np.zeros((1, 2, 8, 16), np.float16)
    acc, m, l = np.zeros(q.shape, np.float32), np.zeros((1, 2, 8)), np.zeros((1, 2, 8))
    pos = np.arange(8)
    with pytest.raises(TypeError, match="silent numpy fallback"):
        be.forward_tile(q, q, q, pos, pos, acc, m, l, scale=1.0, causal=False)
    q32 = q.astype(np.float32)
    acc_t = np.zeros((1, 2, 16, 8), np.float32).transpose(0, 1, 3, 2)  # not C-contiguous
    m32 = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="float32/float64"):
        be.forward_tile(q32, q32, q32, pos, pos, acc_t, m32, m32.copy(), scale=1.0, causal=False)


def _no_fused_backward(monkeypatch, kernel):
    from ringmpi.cpu import fused_backward

    _fused()
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
    monkeypatch.setattr(fused_backward, "available", lambda: False)
    monkeypatch.setattr(fused_backward, "unavailable_reason", lambda: "no compiler (test)")


def test_missing_fused_backward_is_reported_not_silent(monkeypatch):
    """auto: the numpy backward tile runs, and describe()/stats say so; results stay exact."""
    _no_fused_backward(monkeypatch, "auto")
    be = backend.select(np.zeros(1))
    assert be.backward_tile is ringmpi.cpu.numpy_tile.backward_tile
    assert "backward: numpy tile (the fused backward tile is unavailable" in be.describe()
    q, k, v = _qkv(dtype=np.float64)
    out, lse = ringmpi.ring_attention(q, k, v, SELF, causal=True, return_lse=True)
    st = {}
    dout = np.full(q.shape, 0.5) + np.random.default_rng(2).standard_normal(q.shape) * 0.1
    grads = ringmpi.ring_attention_backward(dout, q, k, v, out, lse, SELF, causal=True, stats=st)
    assert "numpy tile" in st["tile"] and "no compiler (test)" in st["tile"]
    for g, w in zip(grads, attention_backward(dout, q, k, v, True)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-10)


def test_missing_fused_backward_under_fused_is_an_error(monkeypatch):
    """RINGMPI_CPU_KERNEL=fused: the backward refuses with the reason, the forward still runs."""
    _no_fused_backward(monkeypatch, "fused")
    be = backend.select(np.zeros(1))
    assert be.backward_tile is None
    spec = AttentionSpec().validate()
    assert be.supports(spec, np.float32, 16) == []
    assert "no compiler (test)" in be.supports(spec, np.float32, 16, backward=True)[0]
    q, k, v = _qkv()
    out, lse = ringmpi.ring_attention(q, k, v, SELF, return_lse=True)
    with pytest.raises(ValueError, match="fused backend cannot run this call: the fused backward"):
        ringmpi.ring_attention_backward(out, q, k, v, out, lse, SELF)


def test_supports_lists_every_reason():
    be = dataclasses.replace(backend.select(np.zeros(1)), max_d=64, backward_tile=None)
    spec = AttentionSpec(head_parallel=2).validate()
    assert be.supports(spec, np.float32, 64) == []
    why = be.supports(spec, np.int32, 65, backward=True)
    assert len(why) == 3 and "dtype int32" in why[0] and "D=65" in why[1], why
    assert be.supports(spec, np.float32, 65, tiles=False) == []  # decode runs no tile
    gpu_like = dataclasses.replace(be, xp=object())
    assert "head_parallel" in gpu_like.supports(spec, np.float32, 8)[0]


def test_gpu_backend_refuses_slices_with_the_reason():
    """The CUDA tiles do not take a mask of slices yet: refused up front, never run."""
    from tools import standin

    spec = AttentionSpec(slices=ringmpi.slices.prefix_lm(8, 2)).validate()
    assert backend.select(np.zeros(1)).supports(spec, np.float32, 16) == []
    with standin.installed() as cupy:
        be = backend.select(cupy.zeros((2, 2), dtype=np.float32))
        assert be.name == "gpu"
        why = be.supports(spec, np.float32, 16)
        assert len(why) == 1 and why[0].startswith("slices (") and "CUDA" in why[0], why
        assert be.supports(spec.__class__(), np.float32, 16) == []
        q = cupy.asarray(np.ones((8, 2, 16), dtype=np.float32))
        with pytest.raises(ValueError, match="gpu backend cannot run this call: slices"):
            ringmpi.ring_attention(q, q, q, SELF, slices=spec.slices)


def _widths_qkv(dtype=np.float64):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((90, 4, 40)).astype(dtype)
    k = (0.5 + rng.standard_normal((90, 2, 40))).astype(dtype)
    v = (1.0 + 0.1 * rng.standard_normal((90, 2, 24))).astype(dtype)
    return q, k, v


def test_value_width_runs_both_fused_tiles(monkeypatch):
    """Dk != Dv (issue 42): the fused forward and backward tiles run it (stats["tile"] says
    so), exact against the dense float64 reference."""
    _fused()
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "auto")
    q, k, v = _widths_qkv()
    st, bst = {}, {}
    out, lse = ringmpi.ring_attention(q, k, v, SELF, causal=True, return_lse=True, stats=st)
    ref, ref_lse = attention(q, k, v, True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-12)
    dout = 0.2 + 0.1 * np.random.default_rng(5).standard_normal(out.shape)
    grads = ringmpi.ring_attention_backward(dout, q, k, v, out, lse, SELF, causal=True, stats=bst)
    for stats in (st, bst):
        assert "forward: fused C" in stats["tile"] and "backward: fused C" in stats["tile"]
    for g, w in zip(grads, attention_backward(dout, q, k, v, True)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-11)


def _backward_without_widths(monkeypatch, kernel):
    """A fused backward tile that cannot take Dk != Dv (as a build from before them)."""
    from ringmpi.cpu import fused_backward

    _fused()
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
    monkeypatch.setattr(fused_backward, "WIDTHS_MISSING", "one head dim (test)")


def test_backward_without_widths_goes_to_numpy_under_auto(monkeypatch):
    """auto: that pass goes to the numpy backward tile, and describe()/stats say why."""
    _backward_without_widths(monkeypatch, "auto")
    q, k, v = _widths_qkv()
    assert "backward: fused C" in backend.select(q, (40, 40)).describe()  # equal widths
    be = backend.select(q, (40, 24))
    assert be.backward_tile is ringmpi.cpu.numpy_tile.backward_tile
    assert "backward: numpy tile (one head dim (test))" in be.describe()
    out, lse = ringmpi.ring_attention(q, k, v, SELF, causal=True, return_lse=True)
    bst = {}
    dout = 0.2 + 0.1 * np.random.default_rng(5).standard_normal(out.shape)
    grads = ringmpi.ring_attention_backward(dout, q, k, v, out, lse, SELF, causal=True, stats=bst)
    assert "backward: numpy tile (one head dim (test))" in bst["tile"]
    for g, w in zip(grads, attention_backward(dout, q, k, v, True)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-11)


def test_backward_without_widths_under_fused_is_refused(monkeypatch):
    """fused: the backward is refused on every rank with the reason (never handed to another
    tile silently); the forward runs."""
    _backward_without_widths(monkeypatch, "fused")
    q, k, v = _widths_qkv(np.float32)
    be = backend.select(q, (40, 24))
    spec = AttentionSpec().validate()
    assert be.supports(spec, np.float32, 40, dv=24) == []
    why = be.supports(spec, np.float32, 40, backward=True, dv=24)
    assert len(why) == 1 and "Dk=40 != value width Dv=24 (one head dim (test))" in why[0], why
    out, lse = ringmpi.ring_attention(q, k, v, SELF, return_lse=True)
    with pytest.raises(ValueError, match="fused backend cannot run this call: key width Dk=40"):
        ringmpi.ring_attention_backward(out, q, k, v, out, lse, SELF)
    with pytest.raises(ValueError, match="one head dim"):  # the tile itself refuses too
        qi, ki, vi = (np.ascontiguousarray(np.moveaxis(x, 0, 1))[None] for x in (q, k, v))
        g = [np.zeros_like(x) for x in (qi, ki, vi)]
        lse_i = np.zeros(qi.shape[:3], np.float32)
        pos = np.arange(qi.shape[2])
        be.backward_tile(qi, ki, vi, np.zeros((*qi.shape[:3], 24), np.float32), lse_i, lse_i,
                         pos, pos, *g, scale=1.0, causal=True)  # fmt: skip
