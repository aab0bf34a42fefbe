"""The fused C tile against the numpy tile (the specification) and the dense reference.

Every test that runs the kernel runs once per ISA path this CPU can execute
(``cpu_isa.host_isas()``: avx512, avx2 and scalar on an AVX-512 machine), each path
loaded side by side in this process with ``fused.load``.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringmpi.cpu import build, fused
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as cpu
from ringmpi.layout import positions
from ringmpi.reference import attention
from ringmpi.softmax import finalize, init_state

pytestmark = pytest.mark.skipif(
    not fused.available(), reason=f"fused kernel unavailable: {fused.unavailable_reason()}"
)

ISAS = cpu_isa.host_isas() if fused.available() else ()


@pytest.fixture(params=ISAS)
def kern(request):
    """The fused kernel compiled for one ISA path."""
    return fused.load(request.param)


# float32: exp polynomial ~1e-7 relative, sums of a few thousand terms; float64: ~1e-15
TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


def _inputs(rng, b, h, hkv, sq, sk, d, dtype, scale_inputs=1.0):
    q = (rng.standard_normal((b, h, sq, d)) * scale_inputs).astype(dtype)
    k = (rng.standard_normal((b, hkv, sk, d)) * scale_inputs).astype(dtype)
    v = rng.standard_normal((b, hkv, sk, d)).astype(dtype)
    return q, k, v


def _both(kern, q, k, v, qp, kp, *, causal, scale=None, state=None):
    """Run both tiles from the same (possibly non-empty) state; return both states."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    st = init_state(q.shape, q.dtype) if state is None else state
    s_ref = tuple(a.copy() for a in st)
    s_fus = tuple(a.copy() for a in st)
    f_ref = cpu.forward_tile(q, k, v, qp, kp, *s_ref, scale=scale, causal=causal)
    f_fus = kern.forward_tile(q, k, v, qp, kp, *s_fus, scale=scale, causal=causal)
    return s_ref, s_fus, f_ref, f_fus


def _assert_states_close(s_ref, s_fus, dtype, tol=None):
    tol = TOL[dtype] if tol is None else tol
    o_ref, lse_ref = finalize(*s_ref)
    o_fus, lse_fus = finalize(*s_fus)
    assert o_fus.dtype == dtype and lse_fus.dtype == dtype
    assert not np.isnan(o_fus).any() and not np.isnan(lse_fus).any()
    np.testing.assert_allclose(o_fus, o_ref, **tol)
    # lse: -inf exactly where the spec has -inf, close elsewhere
    np.testing.assert_array_equal(np.isneginf(lse_fus), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse_fus[fin], lse_ref[fin], **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [16, 64, 80, 128, 256])
def test_dense_matches_numpy_tile(kern, dtype, d):
    rng = np.random.default_rng(d)
    # odd sizes: partial row strips, partial key panels and blocks
    b, h, hkv, sq, sk = 2, 4, 2, 77, 301
    q, k, v = _inputs(rng, b, h, hkv, sq, sk, d, dtype)
    qp, kp = np.arange(sq, dtype=np.int64), np.arange(sk, dtype=np.int64)
    s_ref, s_fus, f_ref, f_fus = _both(kern, q, k, v, qp, kp, causal=False)
    _assert_states_close(s_ref, s_fus, dtype)
    assert f_fus == f_ref == 4 * b * h * sq * sk * d


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, dv", [(40, 24), (8, 64), (192, 128), (576, 512), (59, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_value_width_other_than_key_width(kern, dtype, d, dv, causal):
    """Keys of width Dk and values of width Dv (issue 42): the state is Dv wide, the tile
    equals the numpy tile on every ISA path, from an empty and a carried state, and counts
    2 (Dk + Dv) flops per pair (unmasked)."""
    rng = np.random.default_rng(d * 1000 + dv)
    b, h, hkv, sq, sk = 1, 4, 1 if d > 100 else 2, 53, 211
    q, k, _ = _inputs(rng, b, h, hkv, sq, sk, d, dtype)
    k += dtype(0.5)  # keys with a mean, values with a mean and a small spread
    v = (1.0 + 0.1 * rng.standard_normal((b, hkv, sk, dv))).astype(dtype)
    qp = np.arange(sq, dtype=np.int64) + (sk - sq)  # bottom-right: every row sees keys
    kp = np.arange(sk, dtype=np.int64)
    state = init_state((b, h, sq, dv), dtype)
    for _ in range(2):  # the second call folds the block into a carried state
        s_ref, s_fus, f_ref, f_fus = _both(kern, q, k, v, qp, kp, causal=causal, state=state)
        assert s_fus[0].shape == (b, h, sq, dv)
        _assert_states_close(s_ref, s_fus, dtype)
        if not causal:
            assert f_fus == f_ref == 2 * b * h * sq * sk * (d + dv)
        state = s_ref


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("n,size", [(1000, 3), (1537, 2)])
def test_causal_layouts_full_ring(kern, dtype, layout, n, size):
    """Every (query rank, key rank) pair of a ring, folded in turn, equals dense attention."""
    rng = np.random.default_rng(n + size)
    h, hkv, d = 4, 1, 64
    q, k, v = _inputs(rng, 1, h, hkv, n, n, d, dtype)
    pos = [positions(n, r, size, layout) for r in range(size)]
    ref_out, ref_lse = attention(
        np.moveaxis(q[0], 0, 1),
        np.moveaxis(k[0], 0, 1),
        np.moveaxis(v[0], 0, 1),
        causal=True,
        scale=d**-0.5,
    )  # (n, h, d), (h, n)
    for r in range(size):
        qp = pos[r]
        ql = np.ascontiguousarray(q[:, :, qp])
        st_ref = init_state(ql.shape, dtype)
        st_fus = init_state(ql.shape, dtype)
        for step in range(size):
            src = (r - step) % size
            kp = pos[src]
            kl, vl = np.ascontiguousarray(k[:, :, kp]), np.ascontiguousarray(v[:, :, kp])
            cpu.forward_tile(ql, kl, vl, qp, kp, *st_ref, scale=d**-0.5, causal=True)
            f = kern.forward_tile(ql, kl, vl, qp, kp, *st_fus, scale=d**-0.5, causal=True)
            visible = int((kp[None, :] <= qp[:, None]).sum())
            assert 4 * h * d * visible <= f <= 4 * h * d * len(qp) * len(kp)
        _assert_states_close(st_ref, st_fus, dtype)
        out, lse = finalize(*st_fus)
        tol = TOL[dtype]
        np.testing.assert_allclose(np.moveaxis(out[0], 0, 1), ref_out[qp], **tol)
        np.testing.assert_allclose(lse[0], ref_lse[:, qp], **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_without_visible_key(kern, dtype):
    """Queries before every key: out 0, lse -inf, no NaN; then a later block fills them in."""
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 1, 2, 2, 40, 70, 16, dtype)
    qp = np.arange(40, dtype=np.int64) * 3  # 0..117
    kp = np.arange(70, dtype=np.int64) + 60  # 60..129: rows with qp < 60 see nothing
    s_ref, s_fus, _, _ = _both(kern, q, k, v, qp, kp, causal=True)
    _assert_states_close(s_ref, s_fus, dtype)
    o, lse = finalize(*s_fus)
    assert np.all(o[:, :, :20] == 0) and np.all(np.isneginf(lse[:, :, :20]))
    assert np.all(np.isfinite(lse[:, :, 20:]))
    # fully future block: skipped, zero flops, state untouched
    st = tuple(a.copy() for a in s_fus)
    f = kern.forward_tile(q, k, v, qp, kp + 1000, *st, scale=0.25, causal=True)
    assert f == 0
    for a, b in zip(st, s_fus):
        np.testing.assert_array_equal(a, b)
    # a second block with earlier keys, merged into the existing state
    kp2 = np.arange(70, dtype=np.int64) - 10
    s_ref2, s_fus2, _, _ = _both(kern, q, k, v, qp, kp2, causal=True, state=s_ref)
    _assert_states_close(s_ref2, s_fus2, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_and_nonmonotonic_positions(kern, dtype):
    """Scores of size ~1e3 (exp would overflow without the running max), shuffled positions."""
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, 1, 3, 1, 50, 90, 80, dtype, scale_inputs=6.0)
    qp = rng.permutation(140)[:50].astype(np.int64)
    kp = rng.permutation(140)[:90].astype(np.int64)
    for causal in (False, True):
        s_ref, s_fus, _, _ = _both(kern, q, k, v, qp, kp, causal=causal, scale=1.0)
        smax = np.abs(s_ref[1][np.isfinite(s_ref[1])]).max()
        assert smax > 300
        # a score of size |s| carries a rounding error ~ eps |s| sqrt(D) in either kernel,
        # and exp turns it into the same relative error of the weights
        eps = np.finfo(dtype).eps
        tol = dict(rtol=20 * eps * smax, atol=20 * eps * smax)
        _assert_states_close(s_ref, s_fus, dtype, tol)


def test_random_shapes_float32(kern):
    rng = np.random.default_rng(2024)
    for _ in range(12):
        hkv = int(rng.integers(1, 3))
        h = hkv * int(rng.integers(1, 4))
        b = int(rng.integers(1, 3))
        sq, sk = int(rng.integers(1, 200)), int(rng.integers(1, 400))
        d = int(rng.choice([1, 3, 16, 33, 64, 100, 256]))
        q, k, v = _inputs(rng, b, h, hkv, sq, sk, d, np.float32)
        qp = np.sort(rng.choice(600, sq, replace=False)).astype(np.int64)
        kp = np.sort(rng.choice(600, sk, replace=False)).astype(np.int64)
        causal = bool(rng.integers(0, 2))
        s_ref, s_fus, _, _ = _both(kern, q, k, v, qp, kp, causal=causal)
        _assert_states_close(s_ref, s_fus, np.float32)


def test_progress_called_and_chunked_result_equal(kern):
    rng = np.random.default_rng(3)
    sq = fused.CHUNK_Q * 2 + 5
    q, k, v = _inputs(rng, 1, 2, 1, sq, 300, 64, np.float32)
    qp, kp = np.arange(sq, dtype=np.int64), np.arange(300, dtype=np.int64) * 4
    calls = []
    st1, st2 = init_state(q.shape, np.float32), init_state(q.shape, np.float32)
    kern.forward_tile(q, k, v, qp, kp, *st1, scale=0.125, causal=True)
    kern.forward_tile(
        q, k, v, qp, kp, *st2, scale=0.125, causal=True, progress=lambda: calls.append(1)
    )
    assert len(calls) == 3
    for a, b in zip(st1, st2):
        np.testing.assert_array_equal(a, b)


def test_nan_input_poisons_the_state_like_the_spec(kern):
    q, k, v = _inputs(np.random.default_rng(5), 1, 1, 1, 8, 40, 16, np.float32)
    k[0, 0, 3, 5] = np.nan
    qp, kp = np.arange(8, dtype=np.int64), np.arange(40, dtype=np.int64)
    s_ref, s_fus, _, _ = _both(kern, q, k, v, qp, kp, causal=False)
    assert np.isnan(s_ref[2]).all() and np.isnan(s_fus[2]).all()  # l
    assert np.isnan(s_ref[0]).all() and np.isnan(s_fus[0]).all()  # acc


def test_other_dtype_falls_back_to_numpy(kern):
    q, k, v = _inputs(np.random.default_rng(9), 1, 1, 1, 10, 12, 8, np.float16)
    qp, kp = np.arange(10, dtype=np.int64), np.arange(12, dtype=np.int64)
    s_ref, s_fus, f_ref, f_fus = _both(
        kern, q, k, v, qp, kp, causal=True, state=init_state(q.shape, np.float32)
    )
    assert f_fus == f_ref
    for a, b in zip(s_ref, s_fus):
        np.testing.assert_array_equal(a, b)


def test_cache_reuses_library(kern, tmp_path, monkeypatch):
    """A second build with the same key returns the cached file without compiling."""
    path = kern.path
    assert path is not None and path.is_file()
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(path.parent))
    assert build.build_library("cpu_tile.c", kern.isa) == path
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path))
    built = build.build_library("cpu_tile.c", kern.isa)
    assert built.parent == tmp_path and built.name == path.name
    # the library and its lock file; no temporary left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".lock"]


def test_kernel_reports_its_isa(kern):
    """The library says which path it was compiled for, with the matching vector width."""
    assert kern.isa in cpu_isa.ISAS
    assert kern.simd_width == {"avx512": 64, "avx2": 32, "scalar": 0}[kern.isa]
    assert f"-{kern.isa}-" in kern.path.name
    assert fused.load(kern.isa) is kern  # memoized


def test_progress_exception_stops_the_kernel_and_propagates(kern):
    rng = np.random.default_rng(4)
    sq = fused.CHUNK_Q * 3
    q, k, v = _inputs(rng, 1, 2, 2, sq, 200, 32, np.float32)
    qp, kp = np.arange(sq, dtype=np.int64), np.arange(200, dtype=np.int64)
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("progress failed")

    st = init_state(q.shape, np.float32)
    with pytest.raises(RuntimeError, match="progress failed"):
        kern.forward_tile(q, k, v, qp, kp, *st, scale=0.2, causal=False, progress=boom)
    assert len(calls) == 1  # the kernel stopped at the first failing call


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bq,bk", [(6, 64), (30, 128), (fused.BLOCK_Q, fused.BLOCK_K)])
def test_block_sizes_agree(kern, monkeypatch, dtype, bq, bk):
    """Many small blocks or few large ones: same result (causal, zigzag positions, GQA)."""
    monkeypatch.setattr(fused, "BLOCK_Q", bq)
    monkeypatch.setattr(fused, "BLOCK_K", bk)
    rng = np.random.default_rng(bq + bk)
    n, size = 1400, 2
    q, k, v = _inputs(rng, 1, 4, 2, n // size, n // size, 64, dtype)
    qp = positions(n, 0, size, "zigzag")
    kp = positions(n, 1, size, "zigzag")
    for causal in (False, True):
        s_ref, s_fus, f_ref, f_fus = _both(kern, q, k, v, qp, kp, causal=causal)
        _assert_states_close(s_ref, s_fus, dtype)


@pytest.mark.parametrize("n,h,d,seed", [(300, 2, 32, 1234), (1000, 2, 64, 5), (777, 3, 80, 6)])
def test_large_logits_causal_against_float64(kern, n, h, d, seed):
    """q * 100, causal, float32: lse and out as close to the float64 reference as the spec.

    The error of a score s_ij is a few eps times A_ij = sum_d |q_id scale k_jd| (rounding of
    q scale and of the dot product), so |lse_i - ref| and |out_i - ref| / max|v| are
    measured in units of eps max_j A_ij. Every path must stay below fixed bounds (which the
    numpy tile, the specification, meets too) and within 1.5x of the numpy tile's error: a
    less accurate exp or accumulation on one ISA path fails here.
    """
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, h, n, d)) * 100).astype(np.float32)
    k, v = (rng.standard_normal((1, h, n, d)).astype(np.float32) for _ in range(2))
    pos = np.arange(n, dtype=np.int64)
    scale = d**-0.5
    q64, k64, v64 = (x[0].astype(np.float64) for x in (q, k, v))  # (h, n, d)
    ref_out, ref_lse = attention(*(np.moveaxis(x, 0, 1) for x in (q64, k64, v64)), causal=True)
    ref_out = np.moveaxis(ref_out, 0, 1)  # (h, n, d)
    a = np.abs(q64 * scale) @ np.abs(k64).swapaxes(-1, -2)  # (h, n, n)
    unit = np.finfo(np.float32).eps * np.where(np.tril(np.ones((n, n), bool)), a, 0).max(-1)

    def errors(tile):
        st = init_state(q.shape, np.float32)
        tile(q, k, v, pos, pos, *st, scale=scale, causal=True)
        out, lse = finalize(*st)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        e_lse = float(np.max(np.abs(lse[0] - ref_lse) / unit))
        e_out = float(np.max(np.abs(out[0] - ref_out) / (unit[..., None] * np.abs(v).max())))
        return e_lse, e_out

    spec = errors(cpu.forward_tile)
    got = errors(kern.forward_tile)
    assert spec[0] <= 4 and spec[1] <= 1.5, spec  # the bounds hold for the specification
    assert got[0] <= 4 and got[1] <= 1.5, (kern.isa, got)
    assert got[0] <= 1.5 * spec[0] + 0.25 and got[1] <= 1.5 * spec[1] + 0.25, (kern.isa, got, spec)


@pytest.mark.skipif(
    not {"avx512", "avx2"} <= set(ISAS), reason="needs a CPU that runs both AVX-512 and AVX2"
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bq,bk", [(30, 128), (fused.BLOCK_Q, fused.BLOCK_K)])
def test_avx2_and_avx512_agree_bit_for_bit(monkeypatch, dtype, bq, bk):
    """Same blocks, same FMA chains, same exp, same summation order: identical results."""
    monkeypatch.setattr(fused, "BLOCK_Q", bq)
    monkeypatch.setattr(fused, "BLOCK_K", bk)
    rng = np.random.default_rng(bq + bk)
    cases = [  # b, h, hkv, sq, sk, d, causal, input scale, layout
        (2, 4, 2, 77, 301, 80, False, 1.0, None),
        (1, 2, 1, 700, 700, 64, True, 100.0, "zigzag"),
        (1, 3, 3, 600, 513, 128, True, 1.0, "striped"),
        (1, 2, 2, 50, 90, 33, True, 6.0, "contiguous"),
    ]
    for b, h, hkv, sq, sk, d, causal, sc, layout in cases:
        q, k, v = _inputs(rng, b, h, hkv, sq, sk, d, dtype, scale_inputs=sc)
        if layout is None:
            qp, kp = np.arange(sq, dtype=np.int64), np.arange(sk, dtype=np.int64)
        else:  # a query rank and a key rank of a ring of 2
            qp, kp = positions(2 * sq, 1, 2, layout), positions(2 * sk, 0, 2, layout)[:sk]
        st = init_state(q.shape, dtype)
        init = (st[0] + 0.5, np.full_like(st[1], 1.0), np.full_like(st[2], 2.0))  # non-empty
        for start in (st, init):
            got = []
            for isa in ("avx512", "avx2"):
                s = tuple(a.copy() for a in start)
                fused.load(isa).forward_tile(q, k, v, qp, kp, *s, scale=d**-0.5, causal=causal)
                got.append(s + fused.load(isa).finalize(*s))
            for a, c in zip(*got):
                np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_accuracy(kern, dtype):
    """Scores exactly 0 and x per row (D=1, scale 1), values 0 and 1: acc = exp(x) exactly.

    The kernel's exp rounds t = x log2(e) once (relative error eps/2, absolute eps |t|/2),
    so the bound is a few ulp plus eps |x|. Also: exp(0) = 1 exactly; below the float
    range the result is 0 or a subnormal smaller than the smallest normal number (AVX2
    flushes, AVX-512 and libm round gradually); -inf (a masked key) gives exactly 0.
    """
    x = -np.concatenate([np.linspace(0, 1, 500), np.linspace(1, 80, 1500)]).astype(dtype)
    q = x.reshape(1, 1, -1, 1)
    k = np.array([0.0, 1.0], dtype=dtype).reshape(1, 1, 2, 1)
    v = np.array([0.0, 1.0], dtype=dtype).reshape(1, 1, 2, 1)
    qp, kp = np.zeros(len(x), dtype=np.int64), np.zeros(2, dtype=np.int64)
    acc, m, l = init_state(q.shape, dtype)
    kern.forward_tile(q, k, v, qp, kp, acc, m, l, scale=1.0, causal=False)
    ref = np.exp(x.astype(np.float64))
    eps = float(np.finfo(dtype).eps)
    err = np.abs(acc[0, 0, :, 0] - ref) / ref
    assert np.all(m == 0)
    assert np.all(err <= 3 * eps + eps * np.abs(x)), float(
        np.max(err / (3 * eps + eps * np.abs(x)))
    )
    np.testing.assert_allclose(l[0, 0], 1 + ref, rtol=3 * eps)
    assert acc[0, 0, 0, 0] == 1  # x = 0
    # below the range: 0 <= exp(x) < smallest normal, never negative, NaN or garbage
    tiny = np.finfo(dtype).tiny
    big = {np.float32: [88.5, 100, 150, 1e4, 1e30], np.float64: [709, 746, 1e4, 1e300]}[dtype]
    x = -np.array(big, dtype=dtype)
    q = x.reshape(1, 1, -1, 1)
    qp = np.zeros(len(x), dtype=np.int64)
    acc, m, l = init_state(q.shape, dtype)
    kern.forward_tile(q, k, v, qp, kp, acc, m, l, scale=1.0, causal=False)
    assert np.all(acc[0, 0, :, 0] >= 0) and np.all(acc[0, 0, :, 0] < tiny), acc[0, 0, :, 0]
    assert np.all(l == 1 + acc[..., 0])
    # a masked key (score -inf inside the kernel) weighs exactly 0
    acc, m, l = init_state((1, 1, 1, 1), dtype)
    q1 = np.ones((1, 1, 1, 1), dtype=dtype)
    kern.forward_tile(q1, k, v, qp[:1], np.array([0, 1]), acc, m, l, scale=1.0, causal=True)
    assert acc[0, 0, 0, 0] == 0 and l[0, 0, 0] == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 64, 100])
def test_finalize_matches_softmax_finalize(kern, dtype, d):
    """One-pass finalize: out bit for bit, lse to rounding; empty rows 0/-inf; NaN kept."""
    rng = np.random.default_rng(d)
    b, h, s = 2, 3, 37
    acc = rng.standard_normal((b, h, s, d)).astype(dtype)
    m = rng.standard_normal((b, h, s)).astype(dtype) * 10
    l = rng.uniform(0.5, 100, (b, h, s)).astype(dtype)
    l[0, 1, 3] = 0  # no visible key
    m[0, 1, 3] = -np.inf
    acc[0, 1, 3] = 0
    l[1, 2, 5] = np.nan  # NaN input reached the state
    acc[1, 2, 5] = np.nan
    o_ref, lse_ref = finalize(acc, m, l)
    for seq_major in (False, True):
        out, lse = kern.finalize(acc, m, l, seq_major=seq_major)
        assert out.dtype == dtype and lse.dtype == dtype and out.flags.c_contiguous
        if seq_major:
            out = np.moveaxis(out, -3, -2)
        np.testing.assert_array_equal(out, o_ref)  # NaN == NaN here
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
        # lse = m + log(l): one ulp of log(l) and one rounding of the sum
        fin = np.isfinite(lse_ref)
        bound = 2 * np.finfo(dtype).eps * (np.abs(m) + np.abs(np.log(np.where(fin, l, 1))))
        assert np.all(np.abs(lse[fin] - lse_ref[fin]) <= bound[fin])


def test_numpy_tile_progress_exception_leaves_whole_query_blocks():
    """A raising progress call leaves each query block's (m, l, acc) as it was or complete."""
    rng = np.random.default_rng(5)
    sq, sk = cpu.BLOCK_Q * 2, cpu.BLOCK_K * 3
    q, k, v = _inputs(rng, 1, 2, 1, sq, sk, 32, np.float32)
    qp, kp = np.arange(sq, dtype=np.int64) + sk, np.arange(sk, dtype=np.int64)
    full = init_state(q.shape, np.float32)
    cpu.forward_tile(q, k, v, qp, kp, *full, scale=0.2, causal=False)
    calls = []

    def boom():
        calls.append(1)
        if len(calls) == 5:  # the second key block of the second query block
            raise RuntimeError("progress failed")

    st = init_state(q.shape, np.float32)
    with pytest.raises(RuntimeError, match="progress failed"):
        cpu.forward_tile(q, k, v, qp, kp, *st, scale=0.2, causal=False, progress=boom)
    first, second = slice(0, cpu.BLOCK_Q), slice(cpu.BLOCK_Q, sq)
    for got, want, empty in zip(st, full, init_state(q.shape, np.float32)):  # axis 2: rows
        np.testing.assert_array_equal(got[:, :, first], want[:, :, first])  # complete
        np.testing.assert_array_equal(got[:, :, second], empty[:, :, second])  # untouched
