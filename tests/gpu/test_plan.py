"""The CUDA tiles' host launch plan against brute force, on the CPU (numpy only, no CuPy).

:func:`ringmpi.gpu.plan.host_plan` decides, per (query block, key block) pair,
whether a kernel skips it, computes it without a per-element mask, or masks it
per element. Here every decision is checked against the per-element
visibility lo[i] <= k_pos[j] <= hi[i] over positions from
:func:`ringmpi.positions` (every layout, a few P) for windows, packed
sequences, cross-attention and plain causal:

* a pair with a visible element is never skipped;
* a pair run without the mask has every element visible;
* the skip decision is the envelope rule (min lo / max hi over the rows that
  see something, against the key block's min/max position), and where that
  rule is exact (contiguous layout, one sequence) the computed pairs are
  exactly the pairs with a visible element;
* the pairs count (the flops) and the heaviest-first order follow from it.
"""

from __future__ import annotations

import numpy as np
import pytest

import ringmpi
from ringmpi.gpu import backward, configs, plan
from ringmpi.layout import positions
from ringmpi.mask import make_mask

LENGTHS = (3, 57, 1, 139, 60)
CU = np.concatenate(([0], np.cumsum(LENGTHS)))  # 260 tokens in 5 sequences
CU_K = CU + 13 * np.arange(len(CU))  # longer keys per sequence: packed cross-attention

# (name, nq, nk, causal, mask keywords)
MASKS = [
    ("causal", 260, 260, True, {}),
    ("window 20 causal", 260, 260, True, dict(window=(20, 0))),
    ("window 7,5", 260, 260, False, dict(window=(7, 5))),
    ("window 0,30", 260, 260, False, dict(window=(0, 30))),
    ("packed", 260, 260, False, dict(cu_seqlens=CU)),
    ("packed causal", 260, 260, True, dict(cu_seqlens=CU)),
    ("packed window causal", 260, 260, True, dict(cu_seqlens=CU, window=(9, 0))),
    ("cross 120x300 causal", 120, 300, True, {}),
    ("cross 300x120 causal (empty rows)", 300, 120, True, {}),
    ("cross 90x300 window", 90, 300, False, dict(window=(4, 4))),
    ("cross packed causal", 260, int(CU_K[-1]), True, dict(cu_seqlens=CU, cu_seqlens_k=CU_K)),
    (
        "cross packed window",
        260,
        int(CU_K[-1]),
        False,
        dict(cu_seqlens=CU, cu_seqlens_k=CU_K, window=(3, 2)),
    ),
]

# (bm, bn, g): the block shapes of the kernels (m128n64/n32 packed, m64n64, dQ n32,
# dK/dV with 32 and 64 query rows, the CUDA-core tiles) and a group wider than a block
SHAPES = [
    (128, 64, 3),
    (128, 32, 1),
    (64, 64, 1),
    (64, 32, 1),
    (32, 64, 1),
    (32, 32, 1),
    (16, 16, 1),
    (16, 16, 20),
]


def decode(env: np.ndarray, nqb: int, nkb: int) -> tuple:
    """(computed, full) boolean (nqb, nkb) matrices of a plan, by the kernels' own tests."""
    lo_min, lo_max, hi_min, hi_max = (env[i * nqb : (i + 1) * nqb, None] for i in range(4))
    klo, khi = env[4 * nqb : 4 * nqb + nkb][None], env[4 * nqb + nkb :][None]
    assert len(env) == 4 * nqb + 2 * nkb
    computed = (lo_min <= khi) & (klo <= hi_max)
    full = (lo_max <= klo) & (khi <= hi_min)
    return computed, full


def brute_force(lo, hi, k_pos, bm, bn, g):
    """Per pair: (any element visible, every element visible, envelope rule), from elements."""
    rows = np.repeat(np.arange(len(lo)), g)  # packed row r is query r // g
    rlo, rhi = lo[rows], hi[rows]
    vis = (rlo[:, None] <= k_pos[None, :]) & (k_pos[None, :] <= rhi[:, None])
    qblocks = [slice(i, i + bm) for i in range(0, len(rows), bm)]
    kblocks = [slice(j, j + bn) for j in range(0, len(k_pos), bn)]
    anyv = np.array([[vis[a, b].any() for b in kblocks] for a in qblocks])
    allv = np.array([[vis[a, b].all() for b in kblocks] for a in qblocks])
    env = np.zeros_like(anyv)
    for i, a in enumerate(qblocks):
        seen = rlo[a] <= rhi[a]
        if not seen.any():
            continue  # no row of the block sees anything: every pair skipped
        lmin, hmax = rlo[a][seen].min(), rhi[a][seen].max()
        for j, b in enumerate(kblocks):
            env[i, j] = lmin <= k_pos[b].max() and k_pos[b].min() <= hmax
    return anyv, allv, env


def check_plan(q_pos, k_pos, bm, bn, g, causal, bounds, exact, what):
    env, order, pairs = plan.host_plan(q_pos, k_pos, bm, bn, g, causal, bounds)
    lo, hi = plan.row_bounds(q_pos, causal, bounds)
    nqb, nkb = -(-g * len(q_pos) // bm), -(-len(k_pos) // bn)
    computed, full = decode(env, nqb, nkb)
    anyv, allv, rule = brute_force(lo, hi, k_pos, bm, bn, g)
    assert not (anyv & ~computed).any(), f"{what}: a pair with a visible element is skipped"
    assert not (full & ~allv).any(), f"{what}: a pair with a hidden element runs unmasked"
    assert np.array_equal(computed, rule), f"{what}: skipping differs from the envelope rule"
    if exact:
        assert np.array_equal(computed, anyv), f"{what}: a pair with nothing visible is computed"
    rows = np.diff(np.append(np.arange(0, g * len(q_pos), bm), g * len(q_pos)))
    keys = computed @ np.diff(np.append(np.arange(0, len(k_pos), bn), len(k_pos)))
    assert pairs == int(rows @ keys), what
    assert sorted(order) == list(range(nqb)), what
    assert [keys[j] for j in order] == sorted(keys, reverse=True), f"{what}: not heaviest first"
    # stable: equal loads keep their block order
    for a, b in zip(order, order[1:]):
        assert keys[a] > keys[b] or a < b, f"{what}: order not stable"
    return computed, anyv


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_plan_against_brute_force(layout, p):
    wasted = total = 0
    for name, nq, nk, causal, kw in MASKS:
        mask = make_mask(nq, nk, causal, **kw)
        for rq in range(p):
            q_pos = positions(nq, rq, p, layout, cu_seqlens=mask.cu_q)
            bounds = None if mask.plain else mask.bounds(q_pos)
            for rk in range(p):
                k_pos = positions(nk, rk, p, layout, cu_seqlens=mask.cu_k)
                if len(q_pos) == 0 or len(k_pos) == 0:
                    continue
                # the rule is exact for runs of consecutive positions in one sequence
                exact = layout == "contiguous" and mask.cu_q is None
                for bm, bn, g in SHAPES:
                    what = f"{name} {layout} P={p} q{rq} k{rk} bm={bm} bn={bn} g={g}"
                    comp, anyv = check_plan(q_pos, k_pos, bm, bn, g, causal, bounds, exact, what)
                    wasted += int((comp & ~anyv).sum())
                    total += int(comp.sum())
    # the envelope may compute pairs with nothing visible (striped windows), never skip one;
    # most computed pairs do see something
    assert wasted <= total // 2, f"{layout} P={p}: {wasted} of {total} computed pairs are empty"


def test_causal_without_bounds_is_causal_bounds():
    """bounds=None with causal equals lo = -inf, hi = q_pos; without causal every pair is full."""
    for layout in ringmpi.LAYOUTS:
        for rq, rk in [(0, 0), (1, 0), (0, 2), (2, 1)]:
            q_pos, k_pos = positions(1000, rq, 3, layout), positions(1000, rk, 3, layout)
            lo = np.full(len(q_pos), plan.POS_MIN, dtype=np.int64)
            for bm, bn, g in SHAPES:
                a = plan.host_plan(q_pos, k_pos, bm, bn, g, True)
                b = plan.host_plan(q_pos, k_pos, bm, bn, g, False, (lo, q_pos))
                assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
                env, order, pairs = plan.host_plan(q_pos, k_pos, bm, bn, g, False)
                nqb, nkb = -(-g * len(q_pos) // bm), -(-len(k_pos) // bn)
                computed, full = decode(env, nqb, nkb)
                assert computed.all() and full.all()
                assert pairs == g * len(q_pos) * len(k_pos)
                assert list(order) == list(range(nqb))


def test_empty_rows_and_empty_blocks():
    """Rows that see nothing do not widen the envelope; a block of them is skipped entirely."""
    q_pos = np.arange(200, dtype=np.int64)
    k_pos = np.arange(100, dtype=np.int64)
    lo = np.full(200, 40, dtype=np.int64)
    hi = np.full(200, 50, dtype=np.int64)
    hi[:64] = -1  # rows 0..63 see nothing (lo > hi)
    lo[100:110], hi[100:110] = 1000, 999  # a few more, in the middle
    env, order, pairs = plan.host_plan(q_pos, k_pos, 64, 16, 1, True, (lo, hi))
    computed, full = decode(env, 4, 7)
    assert not computed[0].any(), "a block of empty rows is computed"
    assert env[0] == plan.POS_MAX and env[3 * 4] == plan.POS_MIN
    # rows 64.. see keys 40..50: key blocks [32, 47] and [48, 63] only
    assert [list(np.flatnonzero(r)) for r in computed[1:]] == [[2, 3]] * 3
    assert not full.any(), "blocks with empty rows need the mask"
    assert pairs == (64 + 64 + 8) * 32
    assert order[-1] == 0  # the empty block last
    # no row sees anything: nothing computed at all
    env, _, pairs = plan.host_plan(q_pos, k_pos, 64, 16, 1, True, (lo * 0 + 5, lo * 0 + 4))
    assert pairs == 0 and not decode(env, 4, 7)[0].any()


def test_extreme_positions_do_not_overflow():
    """Positions near the int64 limits: the plan only compares, it never subtracts."""
    big = np.int64(2**62)
    q_pos = big + np.arange(100, dtype=np.int64) * 3
    k_pos = big + np.arange(300, dtype=np.int64)
    lo, hi = q_pos - 5, q_pos + 1
    check_plan(q_pos, k_pos, 32, 32, 1, False, (lo, hi), True, "2**62")
    lo = np.full(100, plan.POS_MIN, dtype=np.int64)
    check_plan(q_pos, k_pos, 64, 16, 2, False, (lo, q_pos), False, "POS_MIN")


def test_row_bounds_are_checked():
    q_pos = np.arange(10, dtype=np.int64)
    lo, hi = plan.row_bounds(q_pos, False, (q_pos.astype(np.int32), q_pos + 3))
    assert lo.dtype == hi.dtype == np.int64 and lo.flags.c_contiguous
    for bad in [(q_pos[:9], q_pos), (q_pos, q_pos.astype(float)), (q_pos,), 3]:
        with pytest.raises(ValueError, match="bounds"):
            plan.row_bounds(q_pos, False, bad)


def test_flops_count_only_computed_pairs():
    """tile_flops / backward_flops: 4 (10) * D per pair of the computed blocks, every kind."""
    mask = make_mask(700, 700, True, window=(40, 0))
    q_pos = positions(700, 1, 2, "contiguous")
    k_pos = positions(700, 0, 2, "contiguous")
    bounds = mask.bounds(q_pos)
    visible = int(((bounds[0][:, None] <= k_pos) & (k_pos <= bounds[1][:, None])).sum())
    b, h, hkv = 2, 6, 2
    for storage, d in [("half_t", 64), ("half_t", 128), ("float", 128), ("double", 64)]:
        for kern in configs.forward_all(storage, d):
            f = plan.tile_flops(kern, q_pos, k_pos, True, b, h, hkv, d, bounds)
            causal = plan.tile_flops(kern, q_pos, k_pos, True, b, h, hkv, d)
            assert 4 * d * b * h * visible <= f < causal, kern.name
        _, k_dq = configs.backward_all(storage, d)
        for kern in k_dq:
            f = backward.backward_flops(kern, q_pos, k_pos, True, b, h, d, bounds)
            causal = backward.backward_flops(kern, q_pos, k_pos, True, b, h, d)
            assert 10 * d * b * h * visible <= f < causal, kern.name
    assert plan.tile_flops(kern, q_pos[:0], k_pos, True, 1, 1, 1, 64, (q_pos[:0],) * 2) == 0


# ---------------------------------------------------------------------------
# the plain (no bounds) plan: block bounds, heaviest-first order, flops
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("g", [1, 3, 8])
def test_host_plan_without_bounds(layout, g):
    n, p = 1000, 3
    for rq, rk in [(0, 0), (1, 0), (0, 2), (2, 1)]:
        q_pos, k_pos = positions(n, rq, p, layout), positions(n, rk, p, layout)
        rowpos = np.repeat(q_pos, g)  # packed row r is position r // g
        for bm, bn, causal in [(128, 64, True), (128, 32, False), (64, 64, True)]:
            env, order, pairs = plan.host_plan(q_pos, k_pos, bm, bn, g, causal)
            qb = [rowpos[i : i + bm] for i in range(0, len(rowpos), bm)]
            kbk = [k_pos[i : i + bn] for i in range(0, len(k_pos), bn)]
            nq, nk = len(qb), len(kbk)
            assert np.array_equal(env[4 * nq : 4 * nq + nk], [b.min() for b in kbk])
            assert np.array_equal(env[4 * nq + nk :], [b.max() for b in kbk])
            if causal:  # lo = -inf, hi = the query positions
                assert np.all(env[: 2 * nq] == plan.POS_MIN)
                assert np.array_equal(env[2 * nq : 3 * nq], [b.min() for b in qb])
                assert np.array_equal(env[3 * nq : 4 * nq], [b.max() for b in qb])
            keys = [sum(len(kb) for kb in kbk if not causal or kb.min() <= b.max()) for b in qb]
            assert pairs == sum(len(b) * kk for b, kk in zip(qb, keys))
            if causal:  # the computed pairs cover every visible one
                assert int((k_pos[None, :] <= rowpos[:, None]).sum()) <= pairs
            assert sorted(order) == list(range(nq))
            assert [keys[j] for j in order] == sorted(keys, reverse=True)


def test_tile_flops_matches_plan_for_each_kind():
    q_pos, k_pos = np.arange(300, dtype=np.int64) + 50, np.arange(260, dtype=np.int64)
    for storage, d in [("half_t", 64), ("float", 128)]:
        for kern in configs.forward_all(storage, d):
            for causal in (False, True):
                f = plan.tile_flops(kern, q_pos, k_pos, causal, 2, 6, 3, d)
                dense = 4 * d * 2 * 6 * 300 * 260
                assert (f == dense) if not causal else (0 < f < dense)
    assert (
        plan.tile_flops(configs.forward_all("float", 64)[0], q_pos[:0], k_pos, True, 1, 1, 1, 64)
        == 0
    )
