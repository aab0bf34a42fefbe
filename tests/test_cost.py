"""ringmpi.cost: visible pairs against a dense mask; stats["flops"] the same on every backend."""

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi import cost
from ringmpi.mask import make_mask

CU = np.array([0, 37, 38, 200, 260])


def _dense_pairs(mask, q_pos, k_pos):
    lo, hi = mask.bounds(q_pos)
    return int(((k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] <= hi[:, None])).sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", [{}, dict(window=(20, 5)), dict(cu_seqlens=CU, window=(30, -1))])
def test_visible_pairs_counts_the_dense_mask(causal, kw):
    rng = np.random.default_rng(3)
    mask = make_mask(260, 260, causal, **kw)
    q_pos = np.sort(rng.choice(260, 90, replace=False))
    k_pos = rng.permutation(260)[:120]  # any order, like striped or zigzag blocks
    want = _dense_pairs(mask, q_pos, k_pos)
    assert cost.visible_pairs(q_pos, k_pos, causal, mask.bounds(q_pos)) == want
    if not kw:  # the causal flag alone (no bounds) counts the same pairs
        assert cost.visible_pairs(q_pos, k_pos, causal) == want
    assert cost.visible_pairs(q_pos[:0], k_pos, causal) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "nk, kw",
    [(260, {}), (260, dict(window=(20, 5))), (260, dict(cu_seqlens=CU, window=(30, -1))),
     (300, {}), (300, dict(cu_seqlens=CU, cu_seqlens_k=np.array([0, 50, 51, 230, 300])))],
)  # fmt: skip
def test_mask_pairs_counts_the_whole_dense_mask(causal, nk, kw):
    """cost.mask_pairs (the job's count of a whole sequence) equals the dense count,
    in one block and in blocks of 7 query rows; self-, cross-, packed attention."""
    mask = make_mask(260, nk, causal, **kw)
    want = _dense_pairs(mask, np.arange(260), np.arange(nk))
    assert want > 0
    assert cost.mask_pairs(mask) == want and cost.mask_pairs(mask, block=7) == want


def test_flops_and_bytes():
    assert cost.flops(10, 64, 8, batch=2) == 4 * 10 * 64 * 8 * 2
    assert cost.flops(10, 64, 8, backward=True) == 10 * 10 * 64 * 8
    assert cost.kv_bytes(100, 2, 64, 4) == 2 * 100 * 2 * 64 * 4
    # keys and values of different widths (issue 42): Dk = 192, Dv = 128
    assert cost.flops(10, 192, 8, dv=128) == 2 * 10 * (192 + 128) * 8
    assert cost.flops(10, 192, 8, backward=True, dv=128) == 2 * 10 * (3 * 192 + 2 * 128) * 8
    assert cost.flops(10, 64, 8, dv=64) == cost.flops(10, 64, 8)
    assert cost.kv_bytes(100, 1, 576, 2, dv=512) == 100 * (576 + 512) * 2


def test_stats_flops_agree_across_cpu_backends(monkeypatch):
    """Under a mask the tiles' own counts differ; stats["flops"] counts the visible pairs."""
    from ringmpi.backend import select

    if select(np.zeros(1)).name != "fused":
        pytest.skip("the fused CPU tile is unavailable here")
    rng = np.random.default_rng(5)
    mean = rng.standard_normal(16)
    q, k, v = (mean + 0.1 * rng.standard_normal((260, 4, 16)) for _ in range(3))
    kw = dict(causal=True, window=(40, 0), cu_seqlens=CU, layout="zigzag")
    got = {}
    for kernel in ("numpy", "fused"):
        monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
        st, stb = {}, {}
        out, lse = ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, return_lse=True, stats=st, **kw)
        ringmpi.ring_attention_backward(q, q, k, v, out, lse, MPI.COMM_SELF, stats=stb, **kw)
        assert st["backend"] == kernel and st["tile_flops"] >= st["flops"] > 0
        assert stb["tile_flops"] >= stb["flops"] > 0
        got[kernel] = (st["flops"], stb["flops"], st["tile_flops"])
    pairs = _dense_pairs(make_mask(260, 260, True, (40, 0), CU), np.arange(260), np.arange(260))
    assert got["numpy"][:2] == got["fused"][:2] == (4 * pairs * 16 * 4, 10 * pairs * 16 * 4)
    assert got["numpy"][2] != got["fused"][2]  # what made stats["flops"] backend-dependent


# ----------------------------------------------------------------------
# per-rank work and imbalance of the layouts (issue 41), counted from dense masks


def _dense_bool(mask):
    """bool (nq, nk) of a Mask: slices from their definition, the rest from bounds."""
    from tools.slicecases import dense_of

    if mask.slices is not None:
        return dense_of(mask.slices, mask.nq, mask.nk)
    lo, hi = mask.bounds(np.arange(mask.nq))
    j = np.arange(mask.nk)[None, :]
    return (j >= lo[:, None]) & (j <= hi[:, None])


def _masks(n):
    from ringmpi import slices as sl
    from ringmpi.mask import mask_of
    from ringmpi.spec import AttentionSpec

    out = [
        make_mask(n, n, True),
        make_mask(n, n, True, (20, 0)),
        make_mask(n, n, False, (30, 5), cu_seqlens=np.array([0, 37, 38, 200, n])),
    ]
    for s in (
        sl.global_local(n, (7, 3), 5),
        sl.global_local(n, 11, 5, causal=True),
        sl.prefix_lm(n, n // 3),
        sl.shared_prefix(n // 4, [n // 4, n // 8, n - n // 4 - n // 4 - n // 8]),
        sl.block_sparse(n, 16, density=0.3, seed=1, causal=True),
    ):
        out.append(mask_of(AttentionSpec(slices=s), n, n))
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_rank_pairs_and_imbalance_count_the_dense_mask(size):
    n = 260
    for mask in _masks(n):
        dense = _dense_bool(mask)
        assert cost.row_pairs(mask, np.arange(n)).tolist() == dense.sum(axis=1).tolist()
        imb = cost.imbalances(mask, size)
        assert set(imb) == set(ringmpi.LAYOUTS) | {"balanced"}
        for layout in imb:
            rows = [
                ringmpi.positions(n, r, size, layout, cu_seqlens=mask.cu_q, mask=mask)
                for r in range(size)
            ]
            want = [int(dense[p].sum()) for p in rows]  # each rank: its queries' visible keys
            got = cost.rank_pairs(mask, size, layout)
            assert got.tolist() == want, (layout, size)
            assert sum(want) == cost.mask_pairs(mask)
            assert imb[layout] == pytest.approx(max(want) * size / sum(want), rel=1e-15)


def test_imbalance_of_cross_attention_and_of_no_pairs():
    """Cross-attention: each rank's queries against all keys, counted from the dense mask."""
    from ringmpi import slices as sl
    from ringmpi.mask import mask_of
    from ringmpi.spec import AttentionSpec

    for cross in (
        make_mask(100, 140, True, (20, 3)),
        make_mask(60, 80, False, None, np.array([0, 25, 60]), np.array([0, 50, 80])),
    ):
        dense = _dense_bool(cross)
        for layout, value in cost.imbalances(cross, 3).items():
            want = [
                int(
                    dense[
                        ringmpi.positions(cross.nq, r, 3, layout, cu_seqlens=cross.cu_q, mask=cross)
                    ].sum()
                )
                for r in range(3)
            ]
            assert cost.rank_pairs(cross, 3, layout).tolist() == want
            assert value == pytest.approx(max(want) * 3 / sum(want), rel=1e-15)
    empty = mask_of(AttentionSpec(slices=sl.Slices([])), 50, 50)
    assert cost.imbalance(empty, 4, "balanced") == 1.0


@pytest.mark.parametrize("size", [4, 8])
def test_balanced_layout_reaches_1_1_on_the_builders(size):
    """Counted, not timed: the greedy's slowest rank within 10% of the mean."""
    from ringmpi import slices as sl
    from ringmpi.mask import mask_of
    from ringmpi.spec import AttentionSpec

    n = 8192
    for s in (
        sl.global_local(n, (256, 256), 64),
        sl.global_local(n, 256, 64, causal=True),
        sl.shared_prefix(n // 4, [n // 8, n // 4, n // 8, n // 4]),
    ):
        mask = mask_of(AttentionSpec(slices=s), n, n)
        assert cost.imbalance(mask, size, "balanced") <= 1.1
    # the unbalanced baseline the layout fixes: global tokens pile work on the first rank
    gl = mask_of(AttentionSpec(slices=sl.global_local(n, (256, 256), 64)), n, n)
    assert cost.imbalance(gl, size, "contiguous") > 1.2
    # every 8th token sees all keys (a strided summary token): striped piles them on rank 0
    strided = sl.Slices(
        [(i, i + 1, 0, n, "full") for i in range(0, n, 8)] + [(0, n, 0, n, "bi_causal")]
    )
    mask = mask_of(AttentionSpec(slices=strided), n, n)
    assert cost.imbalance(mask, size, "balanced") <= 1.1 < 3 < cost.imbalance(mask, size, "striped")
