"""The fused C backward tile under masks beyond causal (per-row key ranges ``bounds``).

Windows, packed sequences (cu_seqlens), both together and cross-attention (queries and keys
of different lengths), with the positions every layout gives each rank (non-contiguous
under zigzag and striped, and within each packed sequence): every (rank, source) tile call
of a ring runs through the numpy backward tile (the specification) and the fused tile with
the same bounds; the two must agree call by call (gradients and reported flops), and the
assembled fused gradients must match the dense float64 gradients of ``ringmpi.reference``
within the rule of :mod:`ringmpi.testing`. Every ISA path the host executes is built and
called in this process (:func:`ringmpi.cpu.build.build_library` with an explicit path).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi.cpu import build, fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as spec
from ringmpi.mask import make_mask
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import assert_close, dense_backward, lse_budget, tolerance

pytestmark = pytest.mark.skipif(
    not fused_backward.available(),
    reason=f"fused backward kernel unavailable: {fused_backward.unavailable_reason()}",
)

ISAS = cpu_isa.host_isas()
WIDTH = {"avx512": 64, "avx2": 32, "scalar": 0}
# fused vs numpy tile, relative to the largest entry: both sum the same terms in another order
TOL = {np.float32: 2e-5, np.float64: 1e-12}

PACKED = np.cumsum([0, 3, 257, 1, 439, 313])  # 1013 tokens, sequences of 3 .. 439
# name: (nq, nk, causal, window, cu_seqlens, cu_seqlens_k)
CASES = {
    "window64_causal": (1000, 1000, True, (64, 0), None, None),
    "window37_20": (1000, 1000, False, (37, 20), None, None),
    "packed_causal": (1013, 1013, True, None, PACKED, None),
    "packed": (1013, 1013, False, None, PACKED, None),
    "packed_window": (1013, 1013, False, (45, 12), PACKED, None),
    "packed_window_causal": (1013, 1013, True, (30, 0), PACKED, None),
    "cross_causal": (300, 1000, True, None, None, None),
    "cross": (300, 1000, False, None, None, None),
    "cross_tall_causal": (1000, 300, True, None, None, None),  # 700 rows see no key
}


@functools.cache
def _lib(isa: str):
    lib = fused_backward.open_library(build.build_library("cpu_backward.c", isa))
    assert int(lib.rm_backward_simd_width_bytes()) == WIDTH[isa], isa
    return lib


def _fused(isa):
    return functools.partial(fused_backward.backward_tile_with, _lib(isa))


def _internal(x, idx):
    """(B, N, H, D) global -> (B, H, len(idx), D) for the tokens idx."""
    return np.ascontiguousarray(np.moveaxis(x[:, idx], 1, 2))


def _mask_kw(case):
    _, _, _, window, cu_q, cu_k = CASES[case]
    return {"window": window, "cu_seqlens": cu_q, "cu_seqlens_k": cu_k}


@functools.cache
def _problem(case: str, d: int = 40):
    """Global inputs, dense forward (float64) and dense float64 gradients of one case."""
    nq, nk, causal, *_ = CASES[case]
    rng = np.random.default_rng(len(case) * 7 + nq + nk)
    q = rng.standard_normal((1, nq, 4, d))
    k = rng.standard_normal((1, nk, 2, d))
    v = rng.standard_normal((1, nk, 2, d))
    dout = rng.standard_normal((1, nq, 4, d))
    out, lse = attention(q, k, v, causal, **_mask_kw(case))
    ref = attention_backward(dout, q, k, v, causal, **_mask_kw(case))
    return q, k, v, dout, out, lse, ref


@functools.cache
def _peer(case: str):
    """Dense float32 gradients: the peer float32 results are judged against."""
    q, k, v, dout, *_ = _problem(case)
    causal = CASES[case][2]
    return dense_backward(dout, q, k, v, causal, dtype=np.float32, **_mask_kw(case))


def _close(got, want, dtype, what):
    assert got.dtype == want.dtype == dtype, what
    assert np.isfinite(got).all(), what
    err = float(np.abs(got - want).max(initial=0.0))
    bound = TOL[dtype] * max(1.0, float(np.abs(want).max(initial=0.0)))
    assert err <= bound, f"{what}: {err:.3g} > {bound:.3g}"


def _ring(case, size, layout, dtype, isas):
    """All tile calls of a ring, numpy tile and the fused tile of each ISA path.

    Asserts each fused call's gradients and flops agree with the numpy tile's; returns, per
    ISA path, the assembled global fused gradients (float64, shaped like q, k, v), the total
    flops and the lse the tiles got.
    """
    nq, nk, causal, window, cu_q, cu_k = CASES[case]
    mask = make_mask(nq, nk, causal, window, cu_q, cu_k)
    q, k, v, dout, out, lse, _ = _problem(case)
    d = q.shape[-1]
    tiles = {"numpy": spec.backward_tile, **{isa: _fused(isa) for isa in isas}}
    grads = {isa: [np.zeros(x.shape) for x in (q, k, v)] for isa in isas}
    flops = dict.fromkeys(isas, 0)
    for r in range(size):
        qp = ringmpi.positions(nq, r, size, layout, cu_seqlens=mask.cu_q)
        bounds = mask.bounds(qp)
        qi, doi = _internal(q, qp).astype(dtype), _internal(dout, qp).astype(dtype)
        lse_i = np.ascontiguousarray(lse[:, :, qp]).astype(dtype)
        delta = np.sum(doi * _internal(out, qp).astype(dtype), axis=-1)
        dq = {t: np.zeros_like(qi) for t in tiles}
        for src in range(size):
            kp = ringmpi.positions(nk, src, size, layout, cu_seqlens=mask.cu_k)
            ki, vi = _internal(k, kp).astype(dtype), _internal(v, kp).astype(dtype)
            dk = {t: np.zeros_like(ki) for t in tiles}
            dv = {t: np.zeros_like(vi) for t in tiles}
            fs = {}
            for name, fn in tiles.items():
                fs[name] = fn(
                    qi,
                    ki,
                    vi,
                    doi,
                    lse_i,
                    delta,
                    qp,
                    kp,
                    dq[name],
                    dk[name],
                    dv[name],
                    scale=d**-0.5,
                    causal=causal,
                    bounds=bounds,
                )
            for isa in isas:
                assert fs[isa] == fs["numpy"], f"{isa}: flops {r}<-{src}"
                flops[isa] += fs[isa]
                _close(dk[isa], dk["numpy"], dtype, f"{isa}: dk {r}<-{src}")
                _close(dv[isa], dv["numpy"], dtype, f"{isa}: dv {r}<-{src}")
                grads[isa][1][:, kp] += np.moveaxis(dk[isa], 1, 2)
                grads[isa][2][:, kp] += np.moveaxis(dv[isa], 1, 2)
        for isa in isas:
            _close(dq[isa], dq["numpy"], dtype, f"{isa}: dq {r}")
            grads[isa][0][:, qp] = np.moveaxis(dq[isa], 1, 2)
    return grads, flops, lse.astype(dtype)


RINGS = [(1, "contiguous")] + [(p, lay) for p in (2, 3) for lay in ringmpi.LAYOUTS]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size,layout", RINGS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_tile_and_dense(case, size, layout, dtype):
    """Call by call equal to the spec; assembled, within the testing rule of dense float64.

    Every ISA path the host executes, each built and loaded side by side.
    """
    all_grads, all_flops, lse = _ring(case, size, layout, dtype, ISAS)
    *_, ref_lse, ref = _problem(case)
    peer = None if dtype == np.float64 else _peer(case)
    nq, nk = CASES[case][:2]
    for isa in ISAS:
        grads, flops = all_grads[isa], all_flops[isa]
        for i, name in enumerate(("dq", "dk", "dv")):
            extra = 0.0 if peer is None else lse_budget(lse, ref_lse, ref[i])
            p = None if peer is None else peer[i]
            what = f"{isa}: {name}"
            ratio = assert_close(MPI.COMM_SELF, grads[i], ref[i], p, what, factor=3.0, extra=extra)
            assert ratio <= 1.0
        if case == "cross_tall_causal":  # bottom-right aligned: queries 0..699 see no key
            assert not grads[0][:, :700].any(), isa
            # query 700 sees key 0 alone (P = 1, dS = 0); the later ones get gradients
            assert np.abs(grads[0][:, 701:]).max(axis=-1).all(), isa
        full = 10 * 4 * nq * nk * grads[0].shape[-1]
        assert 0 < flops <= full
        if layout == "contiguous" and case not in ("cross", "cross_causal"):
            assert flops < full  # windows, packing and the 700 empty rows hide whole blocks


def test_tolerance_can_fail():
    """The float32 bound is a few times the peer's error: a wrong mask exceeds it by far."""
    case = "window64_causal"
    *_, ref = _problem(case)
    grads = _ring(case, 2, "zigzag", np.float32, ISAS[:1])[0][ISAS[0]]
    tol = tolerance(ref[0], _peer(case)[0], dtype="float32", factor=3.0)
    assert np.abs(grads[0] - ref[0]).max() <= tol
    # the gradients of a window one key wider differ from these by much more than tol
    q, k, v, dout, *_ = _problem(case)
    wider = attention_backward(dout, q, k, v, True, window=(65, 0))
    assert np.abs(wider[0] - ref[0]).max() > 100 * tol


def _full_tile(isa, n, sq_pos, sk_pos, bounds, causal, count):
    rng = np.random.default_rng(0)
    d, h, hkv = 64, 2, 1
    q, do = (rng.standard_normal((1, h, len(sq_pos), d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, hkv, len(sk_pos), d)).astype(np.float32) for _ in range(2))
    lse = rng.uniform(2, 6, (1, h, len(sq_pos))).astype(np.float32)
    delta = rng.standard_normal((1, h, len(sq_pos))).astype(np.float32)
    acc = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    return fused_backward.backward_tile_with(
        _lib(isa),
        q,
        k,
        v,
        do,
        lse,
        delta,
        sq_pos,
        sk_pos,
        *acc,
        scale=0.125,
        causal=causal,
        bounds=bounds,
        count=count,
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_skipping_really_happens(isa, layout):
    """A narrow window and short packed sequences compute a small fraction of the tile.

    The kernel's own count (10 nq nk D per computed block pair) against the full tile's
    10 Sq Sk D: rank 0 of 2, queries against its own and the other rank's keys.
    """
    n = 4096
    lens = [97, 300, 41, 512, 180, 256, 333, 77, 200, 450, 64, 128, 390, 211, 600, 257]
    cases = {
        "window": (make_mask(n, n, True, window=(64, 0)), 0.2),
        "packed": (make_mask(n, n, True, cu_seqlens=np.cumsum([0, *lens])), 0.25),
    }
    for name, (mask, most) in cases.items():
        qp = ringmpi.positions(n, 0, 2, layout, cu_seqlens=mask.cu_q)
        bounds = mask.bounds(qp)
        for src in range(2):
            kp = ringmpi.positions(n, src, 2, layout, cu_seqlens=mask.cu_k)
            full = 10 * 2 * len(qp) * len(kp) * 64
            got = _full_tile(isa, n, qp, kp, bounds, True, "kernel")
            want = _full_tile(isa, n, qp, kp, bounds, True, "spec")
            seen = mask.visible(*bounds, np.sort(kp))
            assert (got > 0) == (want > 0) == seen, (name, src, got, want)
            assert got <= most * full, f"{name} {src}: {got / full:.3f} of the tile"
            assert want <= 0.5 * full, f"{name} {src}: spec {want / full:.3f} of the tile"
            # without bounds nothing is skipped: once (no mask in it), on the widest path
            # (the block loop that counts is the same C on every path; the narrower ones
            # count the unmasked flops in test_fused_backward's reruns)
            if name == "window" and isa == ISAS[0]:
                assert _full_tile(isa, n, qp, kp, None, False, "kernel") == full


def _small_args(rng, dtype, sq, sk, h=2, hkv=1, d=16):
    q, do = (rng.standard_normal((1, h, sq, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, hkv, sk, d)).astype(dtype) for _ in range(2))
    lse = rng.uniform(2, 6, (1, h, sq)).astype(dtype)
    delta = rng.standard_normal((1, h, sq)).astype(dtype)
    acc = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    return [q, k, v, do, lse, delta], acc


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_arbitrary_bounds_and_positions(isa, dtype):
    """Shuffled positions, random ranges (some empty, some everything), bounds + causal flag.

    With bounds given, ``causal`` changes nothing (the bounds already say it), as in the
    numpy tile; accumulators that start non-zero are added to.
    """
    rng = np.random.default_rng(21)
    sq, sk = 150, 420
    qp = rng.permutation(1000)[:sq].astype(np.int64)
    kp = rng.permutation(1000)[:sk].astype(np.int64)
    lo = rng.integers(-50, 1000, sq)
    hi = lo + rng.integers(-20, 300, sq)
    lo[:5], hi[:5] = np.iinfo(np.int64).min, np.iinfo(np.int64).max  # every key
    args, acc = _small_args(rng, dtype, sq, sk)
    for a in acc:
        a[...] = rng.standard_normal(a.shape)
    for causal in (False, True):
        want = [a.copy() for a in acc]
        f_n = spec.backward_tile(*args, qp, kp, *want, scale=0.3, causal=causal, bounds=(lo, hi))
        got = [a.copy() for a in acc]
        f_f = _fused(isa)(*args, qp, kp, *got, scale=0.3, causal=causal, bounds=(lo, hi))
        assert f_f == f_n > 0
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            _close(a, b, dtype, name)
        # rows with no visible key keep their dq
        hidden = np.array([not ((lo[i] <= kp) & (kp <= hi[i])).any() for i in range(sq)])
        assert hidden.any()
        np.testing.assert_array_equal(got[0][:, :, hidden], acc[0][:, :, hidden])


def test_nothing_visible_is_skipped_untouched():
    rng = np.random.default_rng(2)
    qp = np.arange(100, dtype=np.int64)
    kp = np.arange(200, 300, dtype=np.int64)
    args, acc = _small_args(rng, np.float32, 100, 100)
    lo, hi = qp - 10, qp  # a window entirely before the keys
    f = fused_backward.backward_tile(*args, qp, kp, *acc, scale=0.3, causal=False, bounds=(lo, hi))
    assert f == 0 and not any(a.any() for a in acc)
    kernel = fused_backward.backward_tile_with(
        _lib(ISAS[0]),
        *args,
        qp,
        kp,
        *acc,
        scale=0.3,
        causal=False,
        bounds=(lo, hi),
        count="kernel",
    )
    assert kernel == 0


def test_progress_and_interrupt_with_bounds(monkeypatch):
    """Progress is called while a masked tile runs; an exception stops it and propagates."""
    monkeypatch.setattr(fused_backward, "CHUNK_PAIRS", 2000)
    rng = np.random.default_rng(3)
    n = 2000
    pos = np.arange(n, dtype=np.int64)
    bounds = make_mask(n, n, True, window=(100, 0)).bounds(pos)
    args, acc = _small_args(rng, np.float32, n, n)
    calls = []
    fused_backward.backward_tile(
        *args,
        pos,
        pos,
        *acc,
        scale=0.2,
        causal=True,
        bounds=bounds,
        progress=lambda: calls.append(1),
    )
    # a call after each computed block pair (each has more than CHUNK_PAIRS pairs), plus one
    # at the end: every query block of 96 rows sees 196 keys, i.e. 1 or 2 key blocks of 256
    nqb = -(-n // fused_backward.BLOCK_Q)
    assert 2 * nqb + 1 <= len(calls) <= 2 * 2 * nqb + 1

    def boom():
        calls.append(1)
        raise RuntimeError("progress failed")

    calls.clear()
    with pytest.raises(RuntimeError, match="progress failed"):
        fused_backward.backward_tile(
            *args, pos, pos, *acc, scale=0.2, causal=True, bounds=bounds, progress=boom
        )
    assert len(calls) == 1


def test_bad_bounds_raise():
    rng = np.random.default_rng(4)
    pos = np.arange(10, dtype=np.int64)
    args, acc = _small_args(rng, np.float32, 10, 10)
    kw = {"scale": 1.0, "causal": False}
    with pytest.raises(ValueError, match=r"bounds hi must be an integer array of shape \(10,\)"):
        fused_backward.backward_tile(*args, pos, pos, *acc, bounds=(pos, pos[:5]), **kw)
    with pytest.raises(ValueError, match="bounds lo must be an integer array"):
        fused_backward.backward_tile(*args, pos, pos, *acc, bounds=(pos * 1.5, pos), **kw)
    with pytest.raises(ValueError, match="pair"):
        fused_backward.backward_tile(*args, pos, pos, *acc, bounds=pos, **kw)
    with pytest.raises(ValueError, match="count"):
        fused_backward.backward_tile_with(_lib(ISAS[0]), *args, pos, pos, *acc, count="both", **kw)


def test_spec_flops_with_bounds_counts_like_the_numpy_tile(monkeypatch):
    """The vectorised count with bounds equals the numpy tile's, small blocks included."""
    monkeypatch.setattr(spec, "BLOCK_Q", 48)
    monkeypatch.setattr(spec, "BLOCK_K", 80 * 4)
    rng = np.random.default_rng(6)
    for case in sorted(CASES):
        nq, nk, causal, window, cu_q, cu_k = CASES[case]
        mask = make_mask(nq, nk, causal, window, cu_q, cu_k)
        for layout in ringmpi.LAYOUTS:
            qp = ringmpi.positions(nq, 1, 3, layout, cu_seqlens=mask.cu_q)
            kp = ringmpi.positions(nk, 2, 3, layout, cu_seqlens=mask.cu_k)
            bounds = mask.bounds(qp)
            args, acc = _small_args(rng, np.float32, len(qp), len(kp), d=4)
            f = spec.backward_tile(*args, qp, kp, *acc, scale=0.5, causal=causal, bounds=bounds)
            got = fused_backward.spec_flops(
                qp, kp, causal=causal, batch=1, heads=2, d=4, bounds=bounds
            )
            assert got == f, (case, layout)
