"""Mask semantics (windows, packed sequences, cross-attention) checked one pair at a time."""

import numpy as np
import pytest

import ringmpi
from ringmpi.layout import counts
from ringmpi.mask import make_mask
from ringmpi.reference import attention
from ringmpi.spec import check_window


def brute_visible(i, j, nq, nk, causal, window, cu_q, cu_k):
    """The documented rule, written out for one (query, key) pair."""
    cu_q = [0, nq] if cu_q is None else list(cu_q)
    cu_k = [0, nk] if cu_k is None else list(cu_k)
    s = max(t for t in range(len(cu_q) - 1) if cu_q[t] <= i)
    if not cu_k[s] <= j < cu_k[s + 1]:
        return False
    iq, jk = i - cu_q[s], j - cu_k[s]
    diag = iq + (cu_k[s + 1] - cu_k[s]) - (cu_q[s + 1] - cu_q[s])
    if causal and jk > diag:
        return False
    if window is not None:
        left, right = window
        if left >= 0 and jk < diag - left:
            return False
        if right >= 0 and jk > diag + right:
            return False
    return True


CASES = [
    dict(nq=40, nk=40, causal=True, window=(5, 0)),
    dict(nq=40, nk=40, causal=False, window=(7, 3)),
    dict(nq=40, nk=40, causal=False, window=(-1, 2)),
    dict(nq=30, nk=70, causal=True, window=None),
    dict(nq=70, nk=30, causal=True, window=None),  # early queries see nothing
    dict(nq=30, nk=70, causal=False, window=(4, 4)),
    dict(nq=12, nk=12, causal=True, window=None, cu=[0, 3, 4, 4, 12]),
    dict(nq=12, nk=20, causal=True, window=(2, 0), cu=[0, 5, 12], cu_k=[0, 9, 20]),
]


@pytest.mark.parametrize("case", CASES)
def test_bounds_match_the_rule(case):
    cu_q, cu_k = case.get("cu"), case.get("cu_k")
    m = make_mask(case["nq"], case["nk"], case["causal"], case["window"], cu_q, cu_k)
    lo, hi = m.bounds(np.arange(case["nq"]))
    for i in range(case["nq"]):
        for j in range(case["nk"]):
            want = brute_visible(
                i,
                j,
                case["nq"],
                case["nk"],
                case["causal"],
                case["window"],
                cu_q,
                cu_k if cu_k is not None else cu_q,
            )
            assert (lo[i] <= j <= hi[i]) == want, (case, i, j)


@pytest.mark.parametrize("case", CASES)
def test_reference_masks_by_the_rule(case, rng):
    nq, nk = case["nq"], case["nk"]
    q = rng.standard_normal((nq, 2, 8))
    k = rng.standard_normal((nk, 1, 8))
    v = rng.standard_normal((nk, 1, 8))
    cu_q, cu_k = case.get("cu"), case.get("cu_k")
    out, lse = attention(
        q, k, v, case["causal"], window=case["window"], cu_seqlens=cu_q, cu_seqlens_k=cu_k
    )
    for i in range(nq):
        vis = [
            j
            for j in range(nk)
            if brute_visible(
                i,
                j,
                nq,
                nk,
                case["causal"],
                case["window"],
                cu_q,
                cu_k if cu_k is not None else cu_q,
            )
        ]
        for h in range(2):
            if not vis:
                assert np.all(out[i, h] == 0) and np.isneginf(lse[h, i])
                continue
            s = (k[vis, 0] @ q[i, h]) / np.sqrt(8)
            p = np.exp(s - s.max())
            assert np.allclose(out[i, h], (p / p.sum()) @ v[vis, 0], rtol=1e-12, atol=1e-12)
            assert np.isclose(lse[h, i], s.max() + np.log(p.sum()), rtol=1e-12)


def test_bad_masks():
    for bad in [(1,), (-2, 0), ("a", 1), (1.5, 2)]:
        with pytest.raises(ValueError, match="window"):
            check_window(bad)
    assert check_window((-1, -1)) is None
    with pytest.raises(ValueError, match="cu_seqlens"):
        make_mask(10, 10, False, cu_seqlens=[0, 5, 9])
    with pytest.raises(ValueError, match="cu_seqlens"):
        make_mask(10, 10, False, cu_seqlens=[0, 6, 5, 10])
    with pytest.raises(ValueError, match="sequences"):
        make_mask(10, 12, False, cu_seqlens=[0, 5, 10], cu_seqlens_k=[0, 12])


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_packed_positions_cover_each_sequence(layout):
    cu = np.array([0, 3, 260, 261, 700, 1013])
    for size in range(1, 6):
        pos = [ringmpi.positions(1013, r, size, layout, cu_seqlens=cu) for r in range(size)]
        assert np.array_equal(np.sort(np.concatenate(pos)), np.arange(1013))
        assert [len(p) for p in pos] == counts(1013, size, layout, cu_seqlens=cu).tolist()
        for a, b in zip(cu[:-1], cu[1:]):  # each sequence is spread like a sequence of its own
            per = [np.count_nonzero((p >= a) & (p < b)) for p in pos]
            assert per == counts(int(b - a), size, layout).tolist()
