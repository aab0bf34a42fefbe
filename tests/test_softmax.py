import numpy as np

from ringmpi import softmax
from ringmpi.reference import attention


def test_merge_of_blocks_equals_full_softmax(rng):
    s = rng.standard_normal((3, 5, 40)) * 4  # (H, S, keys)
    v = rng.standard_normal((40, 7))
    lse_full = np.log(np.exp(s).sum(-1))
    o_full = np.exp(s - lse_full[..., None]) @ v
    o, lse = np.zeros((3, 5, 7)), np.full((3, 5), -np.inf)
    for a, b in [(0, 3), (3, 17), (17, 18), (18, 40)]:
        blk_lse = np.log(np.exp(s[..., a:b]).sum(-1))
        blk_o = np.exp(s[..., a:b] - blk_lse[..., None]) @ v[a:b]
        o, lse = softmax.merge(o, lse, blk_o, blk_lse)
    np.testing.assert_allclose(o, o_full, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, lse_full, rtol=1e-13)


def test_merge_with_empty_side_keeps_empty_rows():
    o = np.zeros((2, 3))
    lse = np.full(2, -np.inf)
    o2, lse2 = softmax.merge(o, lse, o, lse)
    assert np.all(o2 == 0) and np.all(np.isneginf(lse2))


def test_finalize_empty_rows_give_zero_and_minus_inf():
    acc, m, l = softmax.init_state((1, 2, 3, 4), np.float32)
    out, lse = softmax.finalize(acc, m, l)
    assert not np.isnan(out).any() and np.all(out == 0)
    assert np.all(np.isneginf(lse))


def test_reference_matches_direct_formula(rng):
    n, h, hkv, d = 9, 4, 2, 5
    q = rng.standard_normal((n, h, d))
    k = rng.standard_normal((n, hkv, d))
    v = rng.standard_normal((n, hkv, d))
    for causal in (False, True):
        out, lse = attention(q, k, v, causal=causal, scale=0.3)
        for i in range(n):
            for hh in range(h):
                kk = hh // (h // hkv)
                js = range(i + 1) if causal else range(n)
                w = np.array([np.exp(0.3 * q[i, hh] @ k[j, kk]) for j in js])
                expect = sum(w[t] * v[j, kk] for t, j in enumerate(js)) / w.sum()
                np.testing.assert_allclose(out[i, hh], expect, rtol=1e-12)
                np.testing.assert_allclose(lse[hh, i], np.log(w.sum()), rtol=1e-12)
