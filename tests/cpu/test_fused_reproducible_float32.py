"""The float32 reproducible forward (issue 40): its kernel against its numpy oracle, and the
oracle's pieces against exact arithmetic.

Single rank (COMM_SELF); the P-independence is tests/test_reproducible_mpi.py's (its float32
cases run this method). The kernel runs on every ISA path this host executes; the numpy code
of :mod:`ringmpi.reproducible_float32` is its oracle.
"""

from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI
from tools.fingerprint import digest
from tools.reprokernels import by_every_path, fma_instructions, isa_objects

import ringmpi
from ringmpi import reproducible_float32 as rf
from ringmpi.cpu import fused_reproducible_float32
from ringmpi.cpu.isa import host_isas
from ringmpi.cpu.loader import Loader
from ringmpi.reference import attention
from ringmpi.spec import AttentionSpec
from ringmpi.testing import assert_close, dense, random_qkv

SELF = MPI.COMM_SELF
CU = (0, 40, 41, 170, 283)


def _round32(x: Fraction) -> np.float32:
    """x rounded to the nearest float32 (ties to even), exactly."""
    f = np.float32(float(x))  # within an ulp or two
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    dist = [abs(Fraction(float(c)) - x) for c in cands]
    best = min(dist)
    ties = [c for c, d in zip(cands, dist) if d == best]
    if len(ties) > 1:
        ties = [c for c in ties if not int(np.array(c).view(np.int32)) & 1]
    return ties[0]


def test_fma32_is_the_correctly_rounded_fused_multiply_add():
    """Random triples of all magnitudes (cancellations, subnormal results) and exact ties."""
    rng = np.random.default_rng(0)
    n = 3000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    c = (rng.standard_normal(n) * 2.0 ** rng.integers(-120, 120, n)).astype(np.float32)
    c[:500] = (-a[:500].astype(np.float64) * b[:500]).astype(np.float32)  # cancellation
    a[500:600] = np.float32(1.0) + np.float32(2.0**-23)  # products with a bit beyond float32
    b[500:600] = np.float32(1.0) + np.float32(2.0**-23)
    c[500:600] = np.float32(2.0**-24) * rng.choice([-1, 1], 100)  # ties and near-ties
    a[600:700], b[600:700] = np.float32(2.0**-75), np.float32(1.5)  # subnormal results
    c[600:700] = np.float32(0.0)
    got = rf.fma32(a, b, c)
    want = [_round32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(a, b, c)]  # fmt: skip
    assert got.dtype == np.float32
    bad = np.flatnonzero(got.view(np.int32) != np.array(want, dtype=np.float32).view(np.int32))
    assert bad.size == 0, f"{bad.size} wrong, e.g. {a[bad[0]]!r} {b[bad[0]]!r} {c[bad[0]]!r}"


def test_exp2f_accuracy_and_edges():
    """2^x within 2 units in the last place of float32 on [-125, 0]; 0 below; NaN kept."""
    x = np.concatenate([np.linspace(-125, 0, 400001), -np.random.default_rng(1).random(1000)])
    x = x.astype(np.float32)
    got = rf.exp2f(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 2.0, ulps.max()
    edge = rf.exp2f(np.array([0.0, -0.0, -125.0, -125.5, -1e30, -np.inf, np.nan], np.float32))
    assert edge[0] == 1 and edge[1] == 1 and edge[2] > 0
    assert edge[3] == 0 and edge[4] == 0 and edge[5] == 0 and np.isnan(edge[6])


def test_tree64_is_its_fixed_order():
    p = np.random.default_rng(2).random((3, 64)).astype(np.float32)
    a = [((p[:, i] + p[:, 16 + i]) + p[:, 32 + i]) + p[:, 48 + i] for i in range(16)]
    while len(a) > 1:
        half = len(a) // 2
        a = [a[i] + a[i + half] for i in range(half)]
    assert np.array_equal(rf.tree64(p), a[0])


def _random_state(n, dv, nb):
    state = (
        np.full((1, 1, n), -np.inf),
        np.zeros((1, 1, n, rf.FOLDS)),
        np.zeros((1, 1, n, rf.FOLDS, dv)),
        rf.window_grids(nb, np.float64(1.0)),
        np.moveaxis(rf.window_grids(nb, np.full((1, 1, dv), 3.0)), 0, 2).copy(),
    )
    return state


def test_the_level_sums_do_not_depend_on_the_order_of_the_blocks():
    """Block partials with references over several windows (levels moving down, parts
    dropped) and a NaN row: any order of the same blocks gives the same bits (the NaN row:
    its window +inf, whatever its levels hold, which finish does not read)."""
    rng = np.random.default_rng(3)
    n, dv, nb = 5, 7, 40
    blocks = []
    for _ in range(nb):
        r = rng.integers(-90, 90, n).astype(np.float64)
        lb = rng.random(n) * 255 + 0.5
        ob = (rng.random((n, dv)) - 0.5) * 3.0 * lb[:, None]
        blocks.append((r, lb, ob))
    blocks[7][0][4] = np.nan  # row 4 saw a NaN score
    results = []
    for order in (range(nb), range(nb - 1, -1, -1), rng.permutation(nb)):
        state = _random_state(n, dv, nb)
        for i in order:
            r, lb, ob = blocks[i]
            rf.fold_rows(state, 0, 0, 0, np.arange(n), r, lb, ob)
        results.append(digest(*(x[0, 0, :4] for x in state[:3])))  # row 4's levels: unused
        assert np.all(state[0][0, 0, :4] == 32 * np.ceil(np.nanmax([b[0][:4] for b in blocks],
                                                                   axis=0) / 32))  # fmt: skip
        assert state[0][0, 0, 4] == np.inf
    assert results[0] == results[1] == results[2]


def _call(q, k, v, kw):
    return ringmpi.ring_attention(q, k, v, SELF, return_lse=True, reproducible=True, **kw)


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
    q, k, v = random_qkv(np.random.default_rng(2), 300, 2, 1, 16, dtype=np.float32,
                         realistic=True)  # fmt: skip
    kw = dict(causal=True, sinks=[1.0, 9.0])
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")
    want = digest(*_call(q, k, v, kw))
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RINGMPI_CFLAGS", "-ffast-math -ffp-contract=fast")
    fresh = Loader(fused_reproducible_float32.Float32Kernel, "float32 kernel", warn=False)
    monkeypatch.setattr(fused_reproducible_float32, "LOADER", fresh)
    assert digest(*_call(q, k, v, kw)) == want
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    assert digest(*_call(q, k, v, kw)) == want


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


def test_which_calls_run_the_float32_method():
    """Float32 inputs without softcap or ALiBi (sinks are fine), and fewer than 2^19 blocks;
    everything else runs the float64 method of ringmpi.reproducible."""
    plain = AttentionSpec(reproducible=True)
    assert rf.eligible(plain, np.float32, 1000)
    assert rf.eligible(AttentionSpec(reproducible=True, sinks=[1.0]), np.float32, 1000)
    assert not rf.eligible(plain, np.float64, 1000)
    assert not rf.eligible(AttentionSpec(reproducible=True, softcap=5.0), np.float32, 1000)
    assert not rf.eligible(AttentionSpec(reproducible=True, alibi_slopes=[0.5]), np.float32, 9)
    assert rf.eligible(plain, np.float32, rf.BLOCK * (2**19 - 1))
    assert not rf.eligible(plain, np.float32, rf.BLOCK * 2**19)
