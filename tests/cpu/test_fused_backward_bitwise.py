"""The fused backward tile gives the same bits on AVX2 and AVX-512 (issue 21, kernels).

Both vector paths share one SIMD layer (kernels/cpu_simd.h: the same exp and tanh, the
same FMA chains), so with the same blocks the gradients dq, dk, dv must be bit-identical,
as the forward's are (tests/cpu/test_fused.py). Real-shaped values (keys with a mean, values
with a mean and a small spread, an upstream gradient with a mean), GQA, a head dimension
that is not a whole number of vectors, causal and sliding-window masks, with and without
softcap and ALiBi, float32 and float64. Each result is also checked against the numpy
tile (the specification), so two identical wrong answers fail too.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ringmpi.cpu import fused, fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as spec

pytestmark = pytest.mark.skipif(
    not {"avx512", "avx2"} <= set(cpu_isa.host_isas()),
    reason="the host cannot run both AVX-512 and AVX2 code",
)

MODS = {
    "none": (None, False),
    "softcap": (15.0, False),
    "alibi": (None, True),
    "both": (15.0, True),
}


@functools.cache
def _kernel(isa: str) -> fused_backward.BackwardKernel:
    kern = fused_backward.LOADER.load(isa)
    assert kern.isa == isa and kern.simd_width == {"avx512": 64, "avx2": 32}[isa]
    return kern


def _problem(dtype, d: int, mask: str, mod: str, seed: int):
    """Tile arguments: 2 query heads per K/V head, 333 query rows after 700 keys' worth."""
    rng = np.random.default_rng(seed)
    b, h, hkv, sq, sk = 1, 4, 2, 333, 700
    q = rng.standard_normal((b, h, sq, d))
    k = 0.5 + rng.standard_normal((b, hkv, sk, d))
    v = 1.0 + 0.1 * rng.standard_normal((b, hkv, sk, d))
    do = 0.2 + 0.1 * rng.standard_normal((b, h, sq, d))
    qp = np.arange(sk - sq, sk, dtype=np.int64)
    kp = np.arange(sk, dtype=np.int64)
    cap, alibi = MODS[mod]
    kw = {"scale": d**-0.5, "causal": True}
    if mask == "window":
        kw["bounds"] = (qp - 96, qp)
    if cap is not None:
        kw["softcap"] = cap
    if alibi:
        kw["alibi"] = (np.geomspace(0.5, 0.5**4, h), qp)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    # out and lse from the forward tile (the same on both paths), delta = rowsum(dO * out)
    st = (np.zeros((b, h, sq, d), dtype), np.full((b, h, sq), -np.inf, dtype))
    st += (np.zeros((b, h, sq), dtype),)
    fused.load("avx512").forward_tile(q, k, v, qp, kp, *st, **kw)
    out, lse = fused.load("avx512").finalize(*st)
    delta = (do * out).sum(-1)
    return (q, k, v, do, lse, delta, qp, kp), kw


def _grads(tile, args, kw):
    q, k, v = args[:3]
    acc = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    tile(*args, *acc, **kw)
    return acc


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("mod", sorted(MODS))
def test_backward_avx2_and_avx512_agree_bit_for_bit(dtype, d, mask, mod):
    args, kw = _problem(dtype, d, mask, mod, seed=d + len(mod))
    got = {
        isa: _grads(functools.partial(fused_backward.backward_tile_with, _kernel(isa)), args, kw)
        for isa in ("avx512", "avx2")
    }
    want = _grads(spec.backward_tile, args, kw)
    tol = {np.float32: 3e-5, np.float64: 1e-12}[dtype]
    for name, a, c, w in zip(("dq", "dk", "dv"), got["avx512"], got["avx2"], want):
        assert a.dtype == dtype and np.abs(w).max() > 0, name
        # a wrong kernel fails here even when both paths agree
        err = np.abs(a.astype(np.float64) - w).max() / np.abs(w).max()
        assert err <= tol, f"{name}: {err:.3g} > {tol:g} against the numpy tile"
        diff = np.flatnonzero(a.view(np.uint8) != c.view(np.uint8))
        assert diff.size == 0, f"{name}: {diff.size} bytes differ between AVX-512 and AVX2"
