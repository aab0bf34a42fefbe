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
