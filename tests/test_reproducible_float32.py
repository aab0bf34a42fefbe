"""The float32 method of the reproducible mode (issue 40, :mod:`ringmpi.reproducible_float32`):
its pieces against exact arithmetic, the order-independence of its level sums, and which
calls it takes. Its kernel: tests/cpu/test_fused_reproducible_float32.py; its bits at every
P: tests/test_reproducible_mpi.py.
"""

from fractions import Fraction

import numpy as np
from tools.fingerprint import digest

from ringmpi import reproducible_float32 as rf
from ringmpi.spec import AttentionSpec


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


def test_the_bits_do_not_depend_on_the_row_chunks(monkeypatch):
    """The forward calls its kernel (or numpy code) per chunk of query rows (``_ROWS``, a
    memory and speed setting): chunks of 7 rows (no multiple of the kernel's register
    rows), 384 and one chunk give the same out and lse, causal, 301 rows of real-shaped
    values against 700 keys (cross-attention: N not a multiple of anything)."""
    from mpi4py import MPI

    import ringmpi
    from ringmpi.testing import random_qkv

    rng = np.random.default_rng(3)
    q, _, _ = random_qkv(rng, 301, 4, 2, 24, dtype=np.float32, realistic=True)
    _, k, v = random_qkv(rng, 700, 4, 2, 24, dtype=np.float32, realistic=True)
    seen = []
    for rows in (7, 384, 100_000):
        monkeypatch.setattr(rf, "_ROWS", rows)
        st = {}
        out, lse = ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, causal=True, reproducible=True,
                                          return_lse=True, stats=st)  # fmt: skip
        assert st["reproducible_kernel"].endswith("float32")
        assert np.isfinite(out).all() and np.abs(out).max() > 0
        seen.append(digest(out, lse))
    assert seen[0] == seen[1] == seen[2]
