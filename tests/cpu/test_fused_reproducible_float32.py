"""The float32 reproducible method's C kernel (issue 40) against its numpy oracle.

Single rank (COMM_SELF); the P-independence is tests/test_reproducible_mpi.py's and
tests/test_reproducible_backward_mpi.py's (their float32 cases run this method), the
oracle's pieces against exact arithmetic tests/test_reproducible_float32.py's, the
backward end to end on every ISA path tests/cpu/test_fused_reproducible_backward.py's.
The kernel runs on every ISA path this host executes; the numpy code of
:mod:`ringmpi.reproducible_float32` is its oracle: the forward's blocks here through
``ring_attention``, the backward's tiles directly (partial tiles, several mask layers,
huge keys, NaN, an lse that is not the forward's).
"""

import numpy as np
import pytest
from mpi4py import MPI
from tools.fingerprint import digest
from tools.reprokernels import (
    by_every_path,
    flags_keep_the_bits,
    fma_instructions,
    isa_objects,
)

import ringmpi
from ringmpi import reproducible, reproducible_float32
from ringmpi.cpu import fused_reproducible_float32
from ringmpi.cpu.isa import host_isas
from ringmpi.cpu.loader import Loader
from ringmpi.reference import attention
from ringmpi.reproducible import grids
from ringmpi.testing import assert_close, dense, random_qkv

SELF = MPI.COMM_SELF
CU = (0, 40, 41, 170, 283)


MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window=(37, 5)),
    "packed causal window": dict(cu_seqlens=np.array(CU), causal=True, window=(20, -1)),
    "sinks causal": dict(causal=True, sinks=np.array([0.5, 3.0, -2.0, 40.0])),
}


@pytest.mark.parametrize("mask", list(MASKS))
def test_kernel_on_every_isa_gives_the_numpy_bits(mask, monkeypatch):
    """N = 283 (two 256-key blocks, the second partial), D = 24, Dv = 40 (a column tail),
    GQA, real-shaped values: the bits of the numpy code, and the accuracy rule."""
    rng = np.random.default_rng(7)
    q, k, _ = random_qkv(rng, 283, 4, 2, 24, dtype=np.float32, realistic=True)
    v = (0.5 + 0.1 * rng.standard_normal((283, 2, 40))).astype(np.float32)
    kw = MASKS[mask]
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw)
    out, lse = got["numpy"]
    assert_close(SELF, out, ref[0], peer[0], f"{mask} out")
    assert_close(SELF, lse, ref[1], peer[1], f"{mask} lse")


@pytest.mark.parametrize("mask", list(MASKS))
def test_float64_inputs_run_the_pass_in_float64(mask, monkeypatch):
    """Float64 inputs run the same pass in float64 (the multiply-then-add chains, the float64
    method's scores and det_exp, four levels): the kernel's bits on every ISA path are the
    numpy code's, and out and lse meet the float64 rule against the dense float64 reference
    (N = 283, D = 24, Dv = 40, GQA, real-shaped values)."""
    rng = np.random.default_rng(17)
    q, k, _ = random_qkv(rng, 283, 4, 2, 24, dtype=np.float64, realistic=True)
    v = 0.5 + 0.1 * rng.standard_normal((283, 2, 40))
    kw = MASKS[mask]
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    out, lse = got["numpy"]
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert_close(SELF, out, ref[0], None, f"{mask} float64 out")
    assert_close(SELF, lse, ref[1], None, f"{mask} float64 lse")
    st = {}
    ringmpi.ring_attention(q, k, v, SELF, reproducible=True, stats=st, **kw)
    assert st["reproducible_kernel"].endswith(" float64"), st["reproducible_kernel"]


def test_cross_attention_gives_the_numpy_bits(monkeypatch):
    """Cross-attention (more keys than queries, one sequence with no keys: out 0); masks of
    slices run here too (tests/cpu/test_fused_reproducible.py, float32 cases)."""
    rng = np.random.default_rng(8)
    nq, nk = 90, 600
    q, _, _ = random_qkv(rng, nq, 2, 1, 16, dtype=np.float32, realistic=True)
    _, k, v = random_qkv(rng, nk, 2, 1, 16, dtype=np.float32, realistic=True)
    kw = dict(cu_seqlens=np.array([0, 30, nq]), cu_seqlens_k=np.array([0, 0, nk]))
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw)
    assert_close(SELF, got["numpy"][0], ref[0], peer[0], "cross out")
    assert not got["numpy"][0][:30].any()


def test_rows_of_70k_keys_are_accurate(monkeypatch):
    """Four query rows against 70,000 keys (274 blocks; the keys' scores spread over several
    windows: huge keys among them): the kernel's bits are the numpy code's, and out is
    within the float32 rule of the dense float64 reference."""
    rng = np.random.default_rng(9)
    nk = 70000
    _, k, v = random_qkv(rng, nk, 1, 1, 16, dtype=np.float32, realistic=True)
    q = (1.0 + 0.2 * rng.standard_normal((4, 1, 16))).astype(np.float32)
    k[rng.choice(nk, 5, replace=False)] *= 30.0  # a few huge keys: scores far above the rest
    kw = dict(cu_seqlens=np.array([0, 4]), cu_seqlens_k=np.array([0, nk]))
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw)
    assert_close(SELF, got["numpy"][0], ref[0], peer[0], "70k keys out")
    assert_close(SELF, got["numpy"][1], ref[1], peer[1], "70k keys lse")


def test_compiler_flags_from_the_environment_do_not_change_the_bits(monkeypatch, tmp_path):
    """$RINGMPI_CFLAGS with -ffast-math and FMA contraction: the float32 kernel's own flags
    win (its explicit float32 FMAs stay, nothing else is fused or reassociated)."""
    q, k, v = random_qkv(np.random.default_rng(2), 300, 2, 1, 16, dtype=np.float32,
                         realistic=True)  # fmt: skip
    kw = dict(causal=True, sinks=[1.0, 9.0])
    flags_keep_the_bits(
        fused_reproducible_float32,
        fused_reproducible_float32.Float32Kernel,
        q,
        k,
        v,
        kw,
        monkeypatch,
        tmp_path,
    )


def test_every_isa_path_compiles_without_float64_fmas(tmp_path):
    """AVX-512, AVX2 and scalar compile (the ones this host cannot run too); the float32
    fused multiply-adds are the method's, the float64 code (the folds) has none, and the
    scalar path no FMA instruction at all (it emulates the float32 one exactly)."""
    for isa, dis in isa_objects("cpu_reproducible_float32.c", tmp_path).items():
        if dis is None:  # no objdump
            continue
        fused = fma_instructions(dis)
        assert not [x for x in fused if x.endswith(("pd", "sd"))], f"{isa}: a float64 FMA"
        assert (isa == "scalar") == (not fused), f"{isa}: FMAs {sorted(set(fused))}"


def test_kernel_refuses_keys_off_the_block_grid():
    kern = fused_reproducible_float32.load(host_isas()[-1])
    q = np.zeros((1, 1, 4, 8), dtype=np.float32)
    kt, vp = kern.pad_keys(np.zeros((1, 1, 10, 8))), kern.pad_values(np.zeros((1, 1, 10, 8)))
    pos = np.arange(3, 13, dtype=np.int64)  # does not start a key block
    lo, hi = np.zeros((1, 4), dtype=np.int64), np.full((1, 4), 20, dtype=np.int64)
    state = (np.full((1, 1, 4), -np.inf), np.zeros((1, 1, 4, 3)), np.zeros((1, 1, 4, 3, 8)),
             np.ones(3), np.ones((1, 1, 3, 8)))  # fmt: skip
    with pytest.raises(ValueError, match="refused"):
        kern.block(q, kt, vp, pos, lo, hi, state, sk=10, dv=8, rows=(0, 4))


@pytest.mark.parametrize("isa", host_isas())
def test_finish_gives_the_numpy_bits(isa):
    """The one-pass end (rmf_finish) against ringmpi.reproducible.finish on levels shaped like
    real ones (a large level 0, small remainders, a column tail): rows that saw no key
    (out 0), a NaN row, the sinks' factor, and lse from the same row totals."""
    kern = fused_reproducible_float32.load(isa)
    rng = np.random.default_rng(11)
    b, h, sq, dv = 2, 3, 37, 13
    lev = np.array([1.0, 2.0**-32, 2.0**-64])[:, None, None, None]
    l_parts = (rng.uniform(1.0, 300.0, (3, b, h, sq)) * lev).round(20)
    o_parts = (rng.uniform(-5.0, 80.0, (3, b, h, sq, dv)) * lev[..., None]).round(20)
    l_parts[:, 0, 1, 4] = 0.0  # saw no key
    l_parts[0, 1, 2, 9] = np.nan  # a NaN score
    m = rng.uniform(-3.0, 40.0, (b, h, sq))
    for sinks in (None, np.array([0.5, 60.0, -2.0])):
        want = reproducible.finish(l_parts.copy(), o_parts.copy(), m, np.float32, sinks)
        o_lev = np.ascontiguousarray(np.moveaxis(o_parts, 0, 3))  # (B, H, Sq, F, Dv)
        l, a, top = reproducible.denominators(l_parts.copy(), m, sinks)
        got = kern.finish(o_lev, l, a), reproducible.log_sum_exp(l, top, np.float32)
        assert digest(*got) == digest(*want), f"{isa}, sinks {sinks is not None}"
        assert not got[0][1, 9, 2].any() and np.isnan(got[1][1, 2, 9])
        assert sinks is not None or (not got[0][0, 4, 1].any() and got[1][0, 1, 4] == -np.inf)
    with pytest.raises(ValueError, match="wrong shape"):
        kern.finish(o_lev, l[:, :, 1:])


def _step_case(seed, nrows, nkeys, width, *, kpos0=1024, dk=24, dv=40):
    """A backward ring step with real-shaped values (nonzero means, small spreads, a huge
    key), rows seeing keys through two mask layers (all keys up to a diagonal far behind,
    and a window), GQA 4 on 2, padded for ``width`` columns: the arguments of
    ``backward_step`` and the kernel's ``backward``, the sums zero."""
    rng = np.random.default_rng(seed)
    b, h, hkv = 2, 4, 2
    sq, sk = -(-nrows // 64) * 64, -(-nkeys // 64) * 64
    dkp, dvp = -(-dk // width) * width, -(-dv // width) * width

    def arr(shape, mean, spread, n, w):
        x = np.zeros(shape[:-1] + (w,), dtype=np.float32)
        x[..., : shape[-1]] = rng.normal(mean, spread, shape)
        x[:, :, n:] = 0  # rows (keys) past the last: zero
        return x

    q = arr((b, h, sq, dk), 0.3, 0.5, nrows, dkp)
    k = arr((b, hkv, sk, dk), 0.2, 0.5, nkeys, dkp)
    k[0, 1, min(7, nkeys - 1)] *= 25.0  # a huge key
    v = arr((b, hkv, sk, dv), 1.0, 0.3, nkeys, dvp)
    do = arr((b, h, sq, dv), 0.0, 1.0, nrows, dvp)
    qs = (q * np.float32(0.2 * reproducible_float32.LOG2E)).astype(np.float32)
    t = np.einsum("bhid,bhjd->bhij", qs[:, :, :nrows].astype(np.float64),
                  k[:, np.arange(h) // 2, :nkeys].astype(np.float64))  # fmt: skip
    lse = np.zeros((b, h, sq))
    lse[:, :, :nrows] = np.log(np.exp2(t).sum(-1)) + 1.0  # p <= 1
    lh, ll = reproducible_float32.split_lse(lse)
    lh[:, :, nrows:], ll[:, :, nrows:] = 0, 0
    dl = np.zeros((b, h, sq), dtype=np.float32)
    dl[:, :, :nrows] = rng.normal(0.5, 0.2, (b, h, nrows))
    rowpos = kpos0 + 10 + np.arange(sq)  # row i at kpos0 + 10 + i
    lo = np.stack([np.zeros(sq), rowpos - 20]).astype(np.int64)
    hi = np.stack([rowpos - 100, rowpos]).astype(np.int64)
    lo[:, nrows:], hi[:, nrows:] = 1, 0
    nf = 3
    gq = np.ascontiguousarray(np.stack(grids(5000, np.full((b, h, dk), 30.0), nf)))
    gk = np.ascontiguousarray(np.stack(grids(5000, np.full((b, hkv, dk), 30.0), nf)))
    gv = np.ascontiguousarray(np.stack(grids(5000, np.full((b, hkv, dv), 3.0), nf)))
    sums = (np.zeros((nf, b, h, nrows, dk)), np.zeros((nf, b, hkv, nkeys, dk)),
            np.zeros((nf, b, hkv, nkeys, dv)))  # fmt: skip
    return (qs, q, do, lh, ll, dl, k, v), lo, hi, nrows, nkeys, kpos0, (gq, gk, gv), sums


def _run_step(fn, case):
    """fn on the case; (pmax, pairs, cells, the three fold-sum arrays)."""
    *head, sums = case
    return (*fn(*head, list(sums[0]), list(sums[1]), list(sums[2])), *sums)


@pytest.mark.parametrize("shape", [(256, 256), (456, 600), (64, 1), (1, 300)])
def test_backward_step_on_every_isa_gives_the_numpy_bits(shape):
    """Whole and partial tiles (rows and keys past the last chain's end padded), several
    blocks, Dk = 24 and Dv = 40 (padded columns): each ISA path's fold sums, largest p,
    pair and cell counts are the oracle's; the tiles and sub-tiles that no row sees are
    skipped by both (the cells count fewer than rows x keys)."""
    nr, nk = shape
    want = None
    for isa in host_isas():
        kern = fused_reproducible_float32.load(isa)
        if want is None:
            want = _run_step(reproducible_float32.backward_step,
                             _step_case(4, nr, nk, kern.backward_width))  # fmt: skip
            assert want[1] > 0 and np.abs(want[3]).max() > 0, "the case sees nothing"
        got = _run_step(kern.backward, _step_case(4, nr, nk, kern.backward_width))
        assert got[:3] == want[:3], f"{isa}: pmax, pairs, cells {got[:3]} != {want[:3]}"
        for name, a, b in zip(("dq", "dk", "dv"), got[3:], want[3:]):
            assert np.array_equal(a, b), f"{isa} {shape}: {name} fold sums differ"
    if shape == (456, 600):
        assert want[2] < 456 * 600, "no tile was skipped"


def test_backward_step_nan_and_a_wrong_lse():
    """A NaN in one row's dO gives NaN in that row's sums on every path alike; an lse far
    below the forward's gives p = 2^2 (u is clamped at 2), which the caller refuses."""
    for isa in host_isas():
        kern = fused_reproducible_float32.load(isa)
        results = []
        for fn in (reproducible_float32.backward_step, kern.backward):
            case = _step_case(5, 256, 256, kern.backward_width)
            arrays = list(case[0])
            arrays[2][0, 1, 100, 3] = np.nan  # dO of one row
            arrays[3][1, 2, 10] -= 40.0  # lh of one row: an lse far too small
            results.append(_run_step(fn, (tuple(arrays),) + case[1:]))
        want, got = results
        assert want[0] == 4.0 and got[0] == 4.0, (want[0], got[0])
        for a, b in zip(got[3:], want[3:]):
            assert np.array_equal(a, b, equal_nan=True), f"{isa}: sums differ"
        assert np.isnan(want[3][:, 0, 1, 100]).any(), "the NaN row's dq is not NaN"


def test_backward_refuses_bad_arguments():
    kern = fused_reproducible_float32.load(host_isas()[-1])
    arrays, lo, hi, nr, nk, kpos0, gr, sums = _step_case(6, 64, 64, kern.backward_width)
    dq, dk, dv = (list(x) for x in sums)
    bad = list(arrays)
    bad[0] = np.ascontiguousarray(bad[0][..., :-1])  # columns not a multiple of the width
    with pytest.raises(ValueError, match="C-contiguous float32"):
        kern.backward(tuple(bad), lo, hi, nr, nk, kpos0, gr, dq, dk, dv)
    with pytest.raises(ValueError, match="sums of shape"):  # more rows than the sums hold
        kern.backward(arrays, lo, hi, nr - 1, nk, kpos0, gr, dq, dk, dv)
    with pytest.raises(ValueError, match="refused"):  # more rows than the arrays hold
        wide = [np.zeros(x.shape[:3] + (65,) + x.shape[4:]) for x in sums[:1]][0]
        kern.backward(arrays, lo, hi, 65, nk, kpos0, gr, list(wide), dk, dv)
    with pytest.raises(ValueError, match="sums"):
        kern.backward(arrays, lo, hi, nr, nk, kpos0, gr, dq[:2], dk, dv)


def test_backward_compiler_flags_from_the_environment_do_not_change_the_bits(monkeypatch, tmp_path):
    """$RINGMPI_CFLAGS with -ffast-math and FMA contraction: a fresh build of the kernel (a
    private cache) gives the backward step the oracle's bits on every ISA path."""
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RINGMPI_CFLAGS", "-ffast-math -ffp-contract=fast")
    fresh = Loader(fused_reproducible_float32.Float32Kernel, "test build", warn=False)
    for isa in host_isas():
        kern = fresh.load(isa)
        assert str(tmp_path) in str(kern.path)
        want = _run_step(
            reproducible_float32.backward_step, _step_case(8, 300, 300, kern.backward_width)
        )
        got = _run_step(kern.backward, _step_case(8, 300, 300, kern.backward_width))
        assert got[:3] == want[:3]
        assert all(np.array_equal(a, b) for a, b in zip(got[3:], want[3:])), isa
