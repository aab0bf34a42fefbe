"""The fused C tile under masks beyond causal (``bounds``): windows, packed sequences, cross.

Each case runs a whole ring in one process: for every query rank of P, the tile calls
against every rank's K/V block with the positions of ``ringmpi.positions`` (all three
layouts, so the positions are non-contiguous under zigzag / striped and packing), once
with the numpy tile (the specification) and once with the fused kernel of each ISA path
the host executes (``fused.load``: avx512, avx2 and scalar on an AVX-512 machine). The
assembled result is compared with the dense float64 reference; every state with the
numpy tile's. Serial: no MPI ranks are needed.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi.cpu import fused
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as cpu
from ringmpi.layout import positions
from ringmpi.mask import make_mask
from ringmpi.reference import attention
from ringmpi.softmax import finalize, init_state
from ringmpi.testing import dense, tolerance

pytestmark = pytest.mark.skipif(
    not fused.available(), reason=f"fused kernel unavailable: {fused.unavailable_reason()}"
)

ISAS = cpu_isa.host_isas() if fused.available() else ()
H, HKV, D = 4, 2, 24  # GQA; D not a multiple of the vector width
LENGTHS = (3, 257, 1, 439, 313)
CU = np.concatenate(([0], np.cumsum(LENGTHS)))
NP = int(CU[-1])  # 1013

# name: (nq, nk, causal, mask keywords)
CASES = {
    "window 64,0 causal": (1000, 1000, True, dict(window=(64, 0))),
    "window 37,20": (1000, 1000, False, dict(window=(37, 20))),
    "packed causal": (NP, NP, True, dict(cu_seqlens=CU)),
    "packed": (NP, NP, False, dict(cu_seqlens=CU)),
    "window + packed causal": (NP, NP, True, dict(window=(50, 0), cu_seqlens=CU)),
    "window 20,30 + packed": (NP, NP, False, dict(window=(20, 30), cu_seqlens=CU)),
    "cross 300x1000 causal": (300, 1000, True, {}),
    "cross 300x1000": (300, 1000, False, {}),
    "cross 1000x300 causal (empty rows)": (1000, 300, True, {}),
}

# states of the two tiles: float32 exp polynomial ~1e-7 relative over sums of ~1000 terms
TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


@pytest.fixture(params=ISAS)
def kern(request):
    """The fused kernel compiled for one ISA path."""
    return fused.load(request.param)


@functools.cache
def _problem(name: str, dtype):
    """Inputs (S, H, D), the mask, and the float64 reference (out, lse) and dense peer."""
    nq, nk, causal, kw = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    q = rng.standard_normal((nq, H, D)).astype(dtype)
    k = rng.standard_normal((nk, HKV, D)).astype(dtype)
    v = rng.standard_normal((nk, HKV, D)).astype(dtype)
    mask = make_mask(nq, nk, causal, **kw)
    ref = attention(q, k, v, causal, **kw)
    peer = None if dtype == np.float64 else dense(q, k, v, causal, **kw)
    return q, k, v, mask, ref, peer


def _heads(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rows ``pos`` of a (S, H, D) array in the tiles' layout (1, H, n, D), C-contiguous."""
    return np.ascontiguousarray(np.moveaxis(x[pos], 0, 1))[None]


def _visible_pairs(lo, hi, k_pos) -> int:
    return int(((lo[:, None] <= k_pos[None, :]) & (k_pos[None, :] <= hi[:, None])).sum())


def _assert_states_close(s_ref, s_fus, dtype, what):
    o_ref, lse_ref = finalize(*s_ref)
    o_fus, lse_fus = finalize(*s_fus)
    assert not np.isnan(o_fus).any() and not np.isnan(lse_fus).any(), what
    np.testing.assert_allclose(o_fus, o_ref, **TOL[dtype], err_msg=what)
    np.testing.assert_array_equal(np.isneginf(lse_fus), np.isneginf(lse_ref), err_msg=what)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse_fus[fin], lse_ref[fin], **TOL[dtype], err_msg=what)


@functools.cache
def _spec_ring(name, dtype, layout, size):
    """The numpy tile's state after each call of the ring, {(q rank, k rank): (acc, m, l)}.

    Computed once for all ISA paths: the numpy tile is slow on packed positions whose first
    stride differs from the rest (``partition.runs`` then cuts them into one-row runs).
    """
    q, k, v, mask, _, _ = _problem(name, dtype)
    states = {}
    for r in range(size):
        q_pos = positions(mask.nq, r, size, layout, cu_seqlens=mask.cu_q)
        qi = _heads(q, q_pos)
        st = init_state(qi.shape, dtype)
        for s in range(size):
            k_pos = positions(mask.nk, s, size, layout, cu_seqlens=mask.cu_k)
            kw = dict(scale=D**-0.5, causal=mask.causal, bounds=mask.bounds(q_pos))
            cpu.forward_tile(qi, _heads(k, k_pos), _heads(v, k_pos), q_pos, k_pos, *st, **kw)
            states[r, s] = tuple(a.copy() for a in st)
    return states


def _ring(kern, name, dtype, layout, size):
    """The fused tile over every (query rank, key rank) pair, globally ordered result.

    The state is checked against the numpy tile's after every call.
    """
    q, k, v, mask, _, _ = _problem(name, dtype)
    nq, nk, causal = mask.nq, mask.nk, mask.causal
    spec = _spec_ring(name, dtype, layout, size)
    out = np.zeros((H, nq, D))
    lse = np.zeros((H, nq))
    for r in range(size):
        q_pos = positions(nq, r, size, layout, cu_seqlens=mask.cu_q)
        bounds = mask.bounds(q_pos)
        qi = _heads(q, q_pos)
        s_fus = init_state(qi.shape, dtype)
        for s in range(size):
            k_pos = positions(nk, s, size, layout, cu_seqlens=mask.cu_k)
            ki, vi = _heads(k, k_pos), _heads(v, k_pos)
            kw = dict(scale=D**-0.5, causal=causal, bounds=bounds)
            s_ref = spec[r, s]
            before = tuple(a.copy() for a in s_fus)
            f = kern.forward_tile(qi, ki, vi, q_pos, k_pos, *s_fus, **kw)
            what = f"{kern.isa} {name} {layout} P={size} q rank {r} k rank {s}"
            _assert_states_close(s_ref, s_fus, dtype, what)
            # flops: every visible pair scored, nothing when none is visible (state untouched)
            seen = _visible_pairs(*bounds, k_pos)
            assert 4 * D * H * seen <= f <= 4 * D * H * len(q_pos) * len(k_pos), (what, f, seen)
            if seen == 0:
                assert f == 0, what
                for a, b in zip(before, s_fus):
                    np.testing.assert_array_equal(a, b, err_msg=what)
        o, ls = finalize(*s_fus)
        out[:, q_pos], lse[:, q_pos] = o[0], ls[0]
    return np.moveaxis(out, 0, 1), lse


def _assert_matches_reference(got, want, peer, dtype, what):
    """Within 2x the dense peer's error of the float64 reference (float64: 1e-12 relative)."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    fin = np.isfinite(want)
    tol = tolerance(want, peer, dtype=np.dtype(dtype).name)
    err = float(np.abs(got[fin] - want[fin]).max(initial=0.0))
    assert err <= tol, f"{what}: max err {err:.3g} > tol {tol:.3g}"


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_masked_ring_matches_numpy_tile_and_reference(kern, name, dtype, layout, size):
    out, lse = _ring(kern, name, dtype, layout, size)
    _, _, _, _, ref, peer = _problem(name, dtype)
    what = f"{kern.isa} {name} {layout} P={size} {np.dtype(dtype).name}"
    _assert_matches_reference(out, ref[0], None if peer is None else peer[0], dtype, what)
    _assert_matches_reference(lse, ref[1], None if peer is None else peer[1], dtype, what)
    if name.endswith("(empty rows)"):  # queries 0..699 see no key: out 0, lse -inf exactly
        assert np.all(out[:700] == 0) and np.all(np.isneginf(lse[:, :700]))
        assert np.isfinite(lse[:, 700:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shuffled_positions_use_the_per_element_mask(kern, dtype):
    """Positions in no order (blocks not increasing): the kernel's scan + per-element path."""
    rng = np.random.default_rng(3)
    mask = make_mask(NP, NP, True, window=(90, 0), cu_seqlens=CU)
    q_pos = rng.permutation(NP)[:400].astype(np.int64)
    k_pos = rng.permutation(NP)[:700].astype(np.int64)
    bounds = mask.bounds(q_pos)
    q = rng.standard_normal((1, H, 400, D)).astype(dtype)
    k, v = (rng.standard_normal((1, HKV, 700, D)).astype(dtype) for _ in range(2))
    s_ref, s_fus = init_state(q.shape, dtype), init_state(q.shape, dtype)
    kw = dict(scale=D**-0.5, causal=True, bounds=bounds)
    cpu.forward_tile(q, k, v, q_pos, k_pos, *s_ref, **kw)
    f = kern.forward_tile(q, k, v, q_pos, k_pos, *s_fus, **kw)
    _assert_states_close(s_ref, s_fus, dtype, kern.isa)
    assert np.isneginf(finalize(*s_fus)[1]).any()  # some rows see none of these keys
    assert f >= 4 * D * H * _visible_pairs(*bounds, k_pos)


def test_bounds_replace_the_causal_flag(kern):
    """With bounds the causal flag changes nothing (the bounds already hold it), as in the spec."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 300, 32)).astype(np.float32) for _ in range(3))
    pos = np.arange(300, dtype=np.int64)
    bounds = make_mask(300, 300, False, window=(10, 40)).bounds(pos)  # sees 40 keys ahead
    got = []
    for causal in (False, True):
        st = init_state(q.shape, np.float32)
        kern.forward_tile(q, k, v, pos, pos, *st, scale=0.2, causal=causal, bounds=bounds)
        got.append(st)
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_narrow_window_skips_blocks_and_strips(kern):
    """A 64-key causal window over 4096 tokens scores ~its pairs, a small part of full causal."""
    n, d = 4096, 64
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, H, n, d)).astype(np.float32) for _ in range(3))
    pos = np.arange(n, dtype=np.int64)
    bounds = make_mask(n, n, True, window=(64, 0)).bounds(pos)
    seen = _visible_pairs(*bounds, pos)  # 65 per row, less at the start

    def run(**kw):
        st = init_state(q.shape, np.float32)
        t0 = time.perf_counter()
        f = kern.forward_tile(q, k, v, pos, pos, *st, scale=0.125, **kw)
        return f, time.perf_counter() - t0

    f_win, _ = run(causal=True, bounds=bounds)
    f_full, _ = run(causal=True)
    assert 4 * d * H * seen <= f_win <= 1.3 * 4 * d * H * seen, (f_win, seen)
    assert f_win < 0.05 * f_full, (f_win, f_full)  # 4096 x 65 of 4096^2 / 2 pairs: 3.2%
    if kern.isa != "scalar":  # time, loosely (shared machine): medians of 3, side by side
        t_win = np.median([run(causal=True, bounds=bounds)[1] for _ in range(3)])
        t_full = np.median([run(causal=True)[1] for _ in range(3)])
        assert t_win < 0.3 * t_full, (t_win, t_full)


@pytest.mark.skipif(
    not {"avx512", "avx2"} <= set(ISAS), reason="needs a CPU that runs both AVX-512 and AVX2"
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["window 37,20", "window + packed causal", "cross 300x1000"])
def test_avx2_and_avx512_agree_bit_for_bit_under_masks(dtype, name):
    """The strips' first panel differs (panel widths differ) but the results do not."""
    q, k, v, mask, _, _ = _problem(name, dtype)
    for layout in ringmpi.LAYOUTS:
        q_pos = positions(mask.nq, 1, 3, layout, cu_seqlens=mask.cu_q)
        k_pos = positions(mask.nk, 1, 3, layout, cu_seqlens=mask.cu_k)
        bounds = mask.bounds(q_pos)
        qi, ki, vi = _heads(q, q_pos), _heads(k, k_pos), _heads(v, k_pos)
        st = init_state(qi.shape, dtype)
        init = (st[0] + 0.5, np.full_like(st[1], 1.0), np.full_like(st[2], 2.0))  # non-empty
        for start in (st, init):
            got = []
            for isa in ("avx512", "avx2"):
                s = tuple(a.copy() for a in start)
                kw = dict(scale=D**-0.5, causal=mask.causal, bounds=bounds)
                fused.load(isa).forward_tile(qi, ki, vi, q_pos, k_pos, *s, **kw)
                got.append(s + fused.load(isa).finalize(*s))
            for a, c in zip(*got):
                np.testing.assert_array_equal(a, c, err_msg=f"{name} {layout}")


def test_default_tile_runs_bounds_in_the_kernel(monkeypatch):
    """fused.forward_tile with bounds no longer falls back to the numpy tile."""

    def no_numpy(*args, **kwargs):
        raise AssertionError("the numpy tile ran")

    q, k, v, mask, _, _ = _problem("window 64,0 causal", np.float32)
    pos = np.arange(mask.nq, dtype=np.int64)
    qi, ki, vi = _heads(q, pos), _heads(k, pos), _heads(v, pos)
    want = init_state(qi.shape, np.float32)
    kw = dict(scale=D**-0.5, causal=True, bounds=mask.bounds(pos))
    cpu.forward_tile(qi, ki, vi, pos, pos, *want, **kw)
    monkeypatch.setattr(cpu, "forward_tile", no_numpy)
    got = init_state(qi.shape, np.float32)
    assert fused.forward_tile(qi, ki, vi, pos, pos, *got, **kw) > 0
    _assert_states_close(want, got, np.float32, "default kernel")


def test_bad_bounds_are_refused(kern):
    q = np.zeros((1, 1, 10, 8), np.float32)
    pos = np.arange(10, dtype=np.int64)
    st = init_state(q.shape, np.float32)
    lo = np.zeros(10, np.int64)
    for bad in ((lo, lo[:9]), (lo, lo.astype(np.float64)), (lo,), 5):
        with pytest.raises(ValueError, match="bounds"):
            kern.forward_tile(q, q, q, pos, pos, *st, scale=1.0, causal=False, bounds=bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ring_attention_empty_rows_exactly_zero(monkeypatch, dtype):
    """Through ring_attention (fused backend, one rank): rows with no key give out 0, lse -inf."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")

    def no_numpy(*args, **kwargs):
        raise AssertionError("the numpy tile ran")

    monkeypatch.setattr(cpu, "forward_tile", no_numpy)
    q, k, v, _, ref, _ = _problem("cross 1000x300 causal (empty rows)", dtype)
    stats: dict = {}
    out, lse = ringmpi.ring_attention(
        q, k, v, MPI.COMM_SELF, causal=True, return_lse=True, stats=stats
    )
    assert stats["backend"] == "fused"
    assert out.dtype == dtype and np.all(out[:700] == 0) and np.all(np.isneginf(lse[:, :700]))
    assert np.isfinite(lse[:, 700:]).all() and np.abs(out[700:]).max() > 0
    np.testing.assert_allclose(out, ref[0], **TOL[dtype])
    # packed sequences, the first with 40 queries and no key at all
    cu_q, cu_k = np.array([0, 40, 100]), np.array([0, 0, 90])
    rng = np.random.default_rng(8)
    q2 = rng.standard_normal((100, H, D)).astype(dtype)
    k2, v2 = (rng.standard_normal((90, HKV, D)).astype(dtype) for _ in range(2))
    out2, lse2 = ringmpi.ring_attention(
        q2, k2, v2, MPI.COMM_SELF, return_lse=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k
    )
    assert np.all(out2[:40] == 0) and np.all(np.isneginf(lse2[:, :40]))
    ref2 = attention(q2, k2, v2, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    np.testing.assert_allclose(out2, ref2[0], **TOL[dtype])
