import numpy as np
import pytest

import ringmpi
from ringmpi.layout import counts, runs


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_every_token_exactly_once(layout):
    for size in range(1, 10):
        for n in [0, 1, 2, 3, size - 1, size, 2 * size - 1, 2 * size + 1, 97, 1000, 1001]:
            if n < 0:
                continue
            parts = [ringmpi.positions(n, r, size, layout) for r in range(size)]
            allpos = np.concatenate(parts)
            assert allpos.dtype == np.int64
            assert np.array_equal(np.sort(allpos), np.arange(n)), (n, size, layout)
            assert [len(p) for p in parts] == list(counts(n, size, layout))
            # counts differ by at most 2 tokens (zigzag: two chunks) and at most 1 otherwise
            spread = max(len(p) for p in parts) - min(len(p) for p in parts)
            assert spread <= (2 if layout == "zigzag" else 1)


def test_layout_shapes():
    assert ringmpi.positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    assert ringmpi.positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert ringmpi.positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert ringmpi.positions(8, 1, 3, "striped").tolist() == [1, 4, 7]
    assert ringmpi.positions(2, 2, 3, "contiguous").tolist() == []


@pytest.mark.parametrize("bad", [dict(layout="diagonal"), dict(rank=3), dict(size=0), dict(n=-1)])
def test_bad_arguments(bad):
    args = dict(n=10, rank=0, size=3, layout="zigzag") | bad
    with pytest.raises(ValueError):
        ringmpi.positions(**args)


def causal_work(n, size, layout):
    """Visible (query, key) pairs per rank under a causal mask."""
    return np.array([(ringmpi.positions(n, r, size, layout) + 1).sum() for r in range(size)])


@pytest.mark.parametrize("size", [2, 4, 8])
def test_causal_balance(size):
    n = 4096
    for layout, limit in (("zigzag", 1.01), ("striped", 1.01)):
        w = causal_work(n, size, layout)
        assert w.max() / w.mean() < limit, (layout, w)
    w = causal_work(n, size, "contiguous")
    assert w.max() / w.mean() > 1.4  # the unbalanced baseline: (2P-1)/P


def test_runs():
    assert runs(ringmpi.positions(20, 1, 4, "zigzag")) == [(0, 3), (3, 5)]
    assert runs(ringmpi.positions(20, 1, 4, "striped")) == [(0, 5)]
    assert runs(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_head_parallel_positions_cover_each_token_once(layout):
    for size in range(1, 9):
        for u in [d for d in range(1, size + 1) if size % d == 0]:
            for n in (0, 1, size - 1, size, 2 * size + 1, 97):
                pos = [ringmpi.positions(n, r, size, layout, head_parallel=u) for r in range(size)]
                assert np.array_equal(np.sort(np.concatenate(pos)), np.arange(n))
                want = counts(n, size, layout, head_parallel=u)
                assert [len(p) for p in pos] == want.tolist()
                # a head group holds exactly the tokens of its ring position
                for g in range(size // u):
                    grp = np.concatenate(pos[g * u : (g + 1) * u])
                    assert np.array_equal(grp, ringmpi.positions(n, g, size // u, layout))
    with pytest.raises(ValueError, match="head_parallel"):
        ringmpi.positions(10, 0, 4, layout, head_parallel=3)


def test_runs_are_greedy_and_cover_any_positions():
    """A stride change costs one cut, not one run per token; any positions are covered."""
    assert runs(np.array([0, 3, 4, 5, 6])) == [(0, 2), (2, 5)]
    assert runs(np.array([0, 2, 4, 5, 6, 7])) == [(0, 3), (3, 6)]
    assert runs(np.array([5, 5, 4, 9])) == [(0, 1), (1, 2), (2, 4)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        pos = np.cumsum(rng.choice([-1, 0, 1, 1, 2, 3], size=rng.integers(0, 40)))
        got = runs(pos)
        assert [i for a, b in got for i in range(a, b)] == list(range(len(pos)))
        for a, b in got:
            d = np.diff(pos[a:b])
            assert (d > 0).all() and (d == d[0]).all() if len(d) else True
    # packed sequences under striped: about one run per sequence
    cu = np.array([0, 3, 257, 258, 697, 1010])
    pos = ringmpi.positions(1010, 1, 4, "striped", cu_seqlens=cu)
    assert len(runs(pos)) <= 2 * (len(cu) - 1)


# ----------------------------------------------------------------------
# the balanced layout (issue 41): dealt by the mask's cost


def _balanced_masks(n):
    from ringmpi import slices as sl
    from ringmpi.mask import make_mask, mask_of
    from ringmpi.spec import AttentionSpec

    cu = np.array([0, n // 3, min(n // 3 + 1, n), n])
    out = [make_mask(n, n, True), make_mask(n, n, False), make_mask(n, n, True, (17, -1))]
    out.append(make_mask(n, n, False, (5, 9), cu_seqlens=cu))
    for s in (sl.global_local(n, (7, 3), min(5, n)), sl.prefix_lm(n, n // 3), sl.Slices([])):
        out.append(mask_of(AttentionSpec(slices=s), n, n))
    return out


def test_balanced_deals_every_token_once_deterministically():
    from ringmpi.layout import _BALANCED_CACHE, balanced_map

    for n in (0, 1, 5, 64, 65, 300, 1001):
        for mask in _balanced_masks(n):
            for size in (1, 2, 3, 4, 8):
                parts = [ringmpi.positions(n, r, size, "balanced", mask=mask) for r in range(size)]
                for p in parts:
                    assert p.dtype == np.int64 and (np.diff(p) > 0).all()  # stored in order
                assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
                assert [len(p) for p in parts] == list(counts(n, size, "balanced", mask=mask))
                _BALANCED_CACHE.clear()  # computed afresh: the same map
                again = balanced_map(mask, size)
                assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_balanced_heads_x_ring_covers_each_token_once():
    mask = _balanced_masks(300)[4]
    for size, u in ((4, 2), (6, 3), (8, 4)):
        parts = [
            ringmpi.positions(300, r, size, "balanced", head_parallel=u, mask=mask)
            for r in range(size)
        ]
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(300))
        assert [len(p) for p in parts] == list(
            counts(300, size, "balanced", head_parallel=u, mask=mask)
        )


def test_balanced_needs_the_mask_and_deals_cross_attention_by_its_queries():
    from ringmpi.layout import balanced_map
    from ringmpi.mask import make_mask

    with pytest.raises(ValueError, match="computed from the mask"):
        ringmpi.positions(10, 0, 2, "balanced")
    with pytest.raises(ValueError, match="computed from the mask"):
        counts(10, 2, "balanced")
    with pytest.raises(ValueError, match="over 10 tokens"):
        ringmpi.positions(11, 0, 2, "balanced", mask=make_mask(10, 10, True))
    # cross-attention: queries by their cost, keys in contiguous parts
    cross = make_mask(100, 140, True)
    for size in (1, 3, 4):
        q = [ringmpi.positions(100, r, size, "balanced", mask=cross) for r in range(size)]
        k = [ringmpi.positions(140, r, size, "balanced", mask=cross) for r in range(size)]
        assert all(np.array_equal(a, b) for a, b in zip(q, balanced_map(cross, size)))
        assert all(
            np.array_equal(a, ringmpi.positions(140, r, size, "contiguous"))
            for r, a in enumerate(k)
        )
    with pytest.raises(ValueError, match="neither the mask's 100 queries nor its 140 keys"):
        ringmpi.positions(120, 0, 2, "balanced", mask=cross)
    # packed cross-attention of equal totals: the offsets tell queries from keys
    cu, cu_k = np.array([0, 4, 10]), np.array([0, 6, 10])
    packed = make_mask(10, 10, True, None, cu, cu_k)
    assert np.array_equal(
        ringmpi.positions(10, 1, 2, "balanced", cu_seqlens=cu_k, mask=packed), np.arange(5, 10)
    )
    assert list(counts(10, 2, "balanced", cu_seqlens=cu, mask=packed)) == [
        len(p) for p in balanced_map(packed, 2)
    ]
    with pytest.raises(ValueError, match="neither"):
        ringmpi.positions(10, 0, 2, "balanced", mask=packed)  # no offsets: neither side
    assert "balanced" in ringmpi.layout.MASK_LAYOUTS and "balanced" not in ringmpi.LAYOUTS
