"""The dense float64 reference with an explicit boolean mask (or Slices), forward and backward."""

import numpy as np
import pytest
from tools.slicecases import dense_of, random_slices

from ringmpi.reference import attention, attention_backward
from ringmpi.slices import Slices
from ringmpi.testing import random_qkv


def _mask(rng, nq, nk):
    m = rng.random((nq, nk)) < 0.4
    m[1] = False  # a row that sees no key
    return m


def test_explicit_mask_row_by_row():
    rng = np.random.default_rng(0)
    nq, nk, h, hkv, d = 7, 9, 4, 2, 5
    q, k, v = random_qkv(rng, nq, h, hkv, d, nk=nk, realistic=True)
    m = _mask(rng, nq, nk)
    out, lse = attention(q, k, v, mask=m, scale=0.3)
    for i in range(nq):
        for hh in range(h):
            keys = np.flatnonzero(m[i])
            if not len(keys):
                assert (out[i, hh] == 0).all() and lse[hh, i] == -np.inf
                continue
            s = 0.3 * k[keys, hh // 2] @ q[i, hh]
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ v[keys, hh // 2]
            assert np.abs(out[i, hh] - want).max() < 1e-13
            assert abs(lse[hh, i] - (s.max() + np.log(p.sum()))) < 1e-13


def test_explicit_mask_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    nq, nk, h, hkv, d = 5, 6, 2, 1, 3
    q, k, v = random_qkv(rng, nq, h, hkv, d, nk=nk)
    dout = rng.standard_normal(q.shape)
    m = _mask(rng, nq, nk)
    grads = attention_backward(dout, q, k, v, mask=m)
    assert (grads[0][1] == 0).all()  # the empty row gets no gradient

    def loss(qq, kk, vv):
        return float((attention(qq, kk, vv, mask=m)[0] * dout).sum())

    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        num = np.zeros_like(args[which])
        for idx in np.ndindex(num.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert np.abs(num - g).max() < 1e-8, "qkv"[which]


def test_explicit_mask_equals_the_built_in_masks():
    rng = np.random.default_rng(2)
    n = 40
    q, k, v = random_qkv(rng, n, 4, 2, 8, batch=2, realistic=True)
    dout = rng.standard_normal(q.shape)
    tril = np.tril(np.ones((n, n), bool))
    for got, want in (
        (attention(q, k, v, mask=tril), attention(q, k, v, causal=True)),
        (attention(q, k, v, mask=tril, block=7), attention(q, k, v, causal=True)),
        (attention_backward(dout, q, k, v, mask=tril), attention_backward(dout, q, k, v, True)),
    ):
        for a, b in zip(got, want):
            assert np.abs(a - b).max() < 1e-14


def test_slices_give_their_dense_mask():
    rng = np.random.default_rng(3)
    nq, nk = 30, 41
    raw = random_slices(rng, nq, nk, 6)
    q, k, v = random_qkv(rng, nq, 2, 2, 4, nk=nk)
    dense = dense_of(raw, nq, nk)
    for a, b in zip(attention(q, k, v, mask=Slices(raw)), attention(q, k, v, mask=dense)):
        assert np.array_equal(a, b)
    empty = ~dense.any(axis=1)
    out, lse = attention(q, k, v, mask=dense, softcap=5.0, alibi_slopes=[0.1, 0.2])
    assert (out[empty] == 0).all() and (lse[:, empty] == -np.inf).all()
    assert np.isfinite(out).all()


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(mask=np.ones((4, 4), bool), causal=True), "whole mask"),
        (dict(mask=np.ones((4, 4), bool), window=(1, 1)), "whole mask"),
        (dict(mask=np.ones((4, 3), bool)), r"bool \(4, 4\)"),
        (dict(mask=np.ones((4, 4), int)), "bool"),
        (dict(mask=Slices([(0, 5, 0, 4, "full")])), "reaches beyond"),
    ],
)
def test_bad_explicit_masks(kw, words):
    q = np.ones((4, 1, 2))
    with pytest.raises(ValueError, match=words):
        attention(q, q, q, **kw)
    with pytest.raises(ValueError, match=words):
        attention_backward(q, q, q, q, **kw)
