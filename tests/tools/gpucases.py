"""Ring cases on CuPy-typed arrays against the dense float64 reference (stand-in tests).

Inputs are shaped like real data (nonzero means, small spreads) and rounded to
the dtype before the reference sees them; ``bfloat16`` travels as uint16 bits.
Tolerances: twice the error of a dense peer computed in float32, plus the
rounding of the 16-bit output (u = 2**-11 fp16, 2**-8 bf16) relative to the result.
"""

from __future__ import annotations

import numpy as np

import ringmpi
from ringmpi import gpu
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import assert_all, dense, dense_backward

__all__ = ["UNIT", "data", "to_device", "forward_case", "backward_case"]

UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0, "float64": 0.0}


def data(rng, shapes):
    """Arrays with means 0.5 / -0.3 / 2.0 / 0.1 and spreads 0.3 / 0.3 / 0.1 / 0.2, per shape."""
    loc = (0.5, -0.3, 2.0, 0.1)
    sd = (0.3, 0.3, 0.1, 0.2)
    return [loc[i % 4] + sd[i % 4] * rng.standard_normal(s) for i, s in enumerate(shapes)]


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype``, as float64 (bfloat16: round to nearest even)."""
    if dtype == "bfloat16":
        return gpu.from_bf16_bits(gpu.to_bf16_bits(x.astype(np.float32))).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def to_device(cupy, x: np.ndarray, dtype: str):
    """Device array of ``x`` in ``dtype`` (bfloat16 as uint16 bits)."""
    if dtype == "bfloat16":
        return cupy.asarray(gpu.to_bf16_bits(x.astype(np.float32)))
    return cupy.asarray(x.astype(dtype))


def to_host(cupy, x, dtype: str) -> np.ndarray:
    h = cupy.asnumpy(x)
    if dtype == "bfloat16":
        assert h.dtype == np.uint16, f"bfloat16 result came back as {h.dtype}, not uint16 bits"
        return gpu.from_bf16_bits(h).astype(np.float64)
    assert h.dtype == np.dtype(dtype), f"result dtype {h.dtype}, input {dtype}"
    return h.astype(np.float64)


def _shard(cupy, comm, x, layout, dtype, cu=None):
    return to_device(cupy, ringmpi.shard(x, comm, layout, cu_seqlens=cu), dtype)


def forward_case(
    cupy, comm, dtype, layout, causal, n=203, h=4, hkv=2, d=59, mask=None, nk=None, seed=3
):
    """ring_attention on the device arrays of every rank against the reference; returns data."""
    mask = mask or {}
    nk = n if nk is None else nk
    rng = np.random.default_rng(seed)
    arrs = data(rng, [(n, h, d), (nk, hkv, d), (nk, hkv, d), (n, h, d)]) if comm.rank == 0 else None
    q, k, v, dout = (rounded(x, dtype) for x in comm.bcast(arrs))
    cu_q, cu_k = mask.get("cu_seqlens"), mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
    ql, dl = (_shard(cupy, comm, x, layout, dtype, cu_q) for x in (q, dout))
    kl, vl = (_shard(cupy, comm, x, layout, dtype, cu_k) for x in (k, v))
    stats = {}
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, causal=causal, layout=layout, return_lse=True, stats=stats, **mask
    )
    tag = f"{dtype} {layout} causal={causal} D={d} {mask} P={comm.size}"
    assert_all(comm, stats.get("backend") == "gpu", f"{tag}: backend {stats.get('backend')}")
    assert_all(comm, type(out) is cupy.ndarray, f"{tag}: out is a {type(out)}")
    full = ringmpi.gather(to_host(cupy, out, dtype), n, comm, layout, cu_seqlens=cu_q)
    ref, ref_lse = attention(q, k, v, causal, **mask)
    peer, _ = dense(q, k, v, causal, **mask)
    tol = 2 * np.abs(peer - ref).max() + 1e-6 + 2 * UNIT[dtype] * np.abs(ref).max()
    if dtype == "float64":
        tol = 1e-12 * max(1.0, np.abs(ref).max())
    err = np.abs(full - ref).max()
    assert_all(comm, err <= tol, f"{tag} out: err {err:.3g} > tol {tol:.3g}")
    glse = ringmpi.gather(cupy.asnumpy(lse), n, comm, layout, cu_seqlens=cu_q, axis=-1)
    want = ref_lse
    fin = np.isfinite(want)
    ok = np.array_equal(np.isfinite(glse), fin)
    err = np.abs(glse[fin] - want[fin]).max(initial=0.0)
    assert_all(
        comm,
        ok and err <= 1e-4 * max(1.0, np.abs(want[fin]).max(initial=0.0)),
        f"{tag} lse: err {err:.3g}",
    )
    return (q, k, v, dout), (ql, kl, vl, dl), (out, lse), tag


def out_correction(dout, q, k, v, out, causal, mask):
    """Change of the exact (dq, dk, dv) when delta = sum(dout * out) uses ``out`` (the ring's
    own rounded output, which the backward takes as given) instead of the exact output.

    The gradients are linear in delta: dS changes by -P * (delta_out - delta_exact) times
    the score modifiers' derivative d s'/d s; the modifiers among ``mask``'s keywords (spec
    field names: ``softcap``, ``alibi_slopes``, ...) change P as in the reference. Built
    from :mod:`ringmpi.scoremods` and the mask alone (no private helper of the reference).
    """
    from types import SimpleNamespace

    from ringmpi import scoremods
    from ringmpi.mask import make_mask

    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    h, hkv = q.shape[-2], k.shape[-2]
    group = h // hkv
    qh = np.moveaxis(q, -3, -2)
    kh = np.repeat(np.moveaxis(k, -3, -2), group, axis=-3)
    scale = 1.0 / np.sqrt(q.shape[-1])  # the reference's default
    n_q, n_k = qh.shape[-2], kh.shape[-2]
    m = make_mask(
        n_q, n_k, causal, mask.get("window"), mask.get("cu_seqlens"), mask.get("cu_seqlens_k")
    )
    rows = np.arange(n_q)
    s = scale * (qh @ np.swapaxes(kh, -1, -2))
    spec = SimpleNamespace(**{f: mask.get(f) for f in scoremods.names()})
    kw = scoremods.tile_keywords(spec, slice(None), lambda: m.alibi_positions(rows))
    dmod = scoremods.apply(s, scoremods.pack(kw, h, n_q), None, np.arange(n_k), (h,))
    if m.causal or not m.plain:
        lo, hi = m.bounds(rows)
        j = np.arange(n_k)[None, :]
        s = np.where((lo[:, None] <= j) & (j <= hi[:, None]), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
    z = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, 0)
    do, o_ring = (np.moveaxis(x, -3, -2) for x in (dout, out))
    o_exact = p @ np.repeat(np.moveaxis(v, -3, -2), group, axis=-3)
    dd = np.sum(do * (o_ring - o_exact), axis=-1, keepdims=True)
    ds = -p * dd
    if dmod is not None:
        ds = ds * dmod
    dq = np.moveaxis(scale * (ds @ kh), -2, -3)
    dk = scale * (np.swapaxes(ds, -1, -2) @ qh)
    dk = np.moveaxis(dk.reshape(-1, group, *dk.shape[-2:]).sum(axis=1), -2, -3)
    return dq, dk, np.zeros_like(v)


def backward_case(cupy, comm, dtype, layout, causal, mask=None, **kw):
    """ring_attention_backward on device arrays against the float64 reference gradients."""
    from ringmpi.backward import ring_attention_backward

    mask = mask or {}
    (q, k, v, dout), (ql, kl, vl, dl), (out, lse), tag = forward_case(
        cupy, comm, dtype, layout, causal, mask=mask, **kw
    )
    cu_q = mask.get("cu_seqlens")
    full_out = ringmpi.gather(to_host(cupy, out, dtype), len(q), comm, layout, cu_seqlens=cu_q)
    stats = {}
    grads = ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, causal=causal, layout=layout, stats=stats, **mask
    )
    assert_all(comm, stats.get("backend") == "gpu", f"{tag}: backward backend")
    want = attention_backward(dout, q, k, v, causal, **mask)
    other = dense_backward(dout, q, k, v, causal, **mask)
    corr = out_correction(dout, q, k, v, full_out, causal, mask)
    cu_q, cu_k = mask.get("cu_seqlens"), mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
    sizes = (len(q), len(k), len(k))
    for nm, g, w, o, c, n, cu in zip("qkv", grads, want, other, corr, sizes, (cu_q, cu_k, cu_k)):
        assert_all(comm, type(g) is cupy.ndarray, f"{tag} d{nm} is a {type(g)}")
        got = ringmpi.gather(to_host(cupy, g, dtype), n, comm, layout, cu_seqlens=cu)
        w = w + c  # the exact gradient for the out the ring returned
        scale = np.abs(w).max()
        if dtype == "float64":
            tol = 1e-11 * max(1.0, scale)
        else:  # twice the peer's float32 error, and the rounding of a 16-bit result
            tol = 3 * np.abs(o - w).max() + 1e-6 + UNIT[dtype] * scale
        err = np.abs(got - w).max()
        assert_all(comm, err <= tol, f"{tag} d{nm}: err {err:.3g} > tol {tol:.3g}")
