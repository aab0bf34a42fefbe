"""Score modifiers (ALiBi, softcap, sinks): reference, numpy tile and the serial API.

The dense reference is checked against a straightforward float64 formula written
here row by row (and its gradients against finite differences of that formula);
the numpy tile (the spec the fused and CUDA tiles are tested against) is run over
every rank's blocks of a simulated ring against the reference.
"""

import numpy as np
import pytest

import ringmpi
from ringmpi import reference, softmax
from ringmpi.cpu import numpy_tile
from ringmpi.mask import make_mask
from ringmpi.testing import assert_close, dense, dense_backward, random_qkv


def _formula(q, k, v, causal, scale, cu_q, cu_k, window, slopes, cap, sinks):
    """out (B, Sq, H, D), lse (B, H, Sq): one row at a time, in float64."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    cu_q = [0, nq] if cu_q is None else list(cu_q)
    cu_k = [0, nk] if cu_k is None else list(cu_k)
    out = np.zeros((b, nq, h, d))
    lse = np.zeros((b, h, nq))
    for i in range(nq):
        s_i = max(s for s in range(len(cu_q) - 1) if cu_q[s] <= i)
        lq, lk = cu_q[s_i + 1] - cu_q[s_i], cu_k[s_i + 1] - cu_k[s_i]
        diag = (i - cu_q[s_i]) + lk - lq  # bottom-right aligned, in the sequence's keys
        js = []
        for j in range(cu_k[s_i], cu_k[s_i + 1]):
            jj = j - cu_k[s_i]
            if causal and jj > diag:
                continue
            if window is not None and window[0] >= 0 and jj < diag - window[0]:
                continue
            if window is not None and window[1] >= 0 and jj > diag + window[1]:
                continue
            js.append(j)
        js = np.array(js, dtype=np.int64)
        for bb in range(b):
            for hh in range(h):
                kv = hh // (h // hkv)
                x = scale * (k[bb, js, kv] @ q[bb, i, hh])
                if cap is not None:
                    x = cap * np.tanh(x / cap)
                if slopes is not None:
                    x = x - slopes[hh] * np.abs(cu_k[s_i] + diag - js)
                logits = list(x) + ([sinks[hh]] if sinks is not None else [])
                if not logits:
                    lse[bb, hh, i] = -np.inf
                    continue
                mx = max(logits)
                z = sum(np.exp(t - mx) for t in logits)
                lse[bb, hh, i] = mx + np.log(z)
                w = np.exp(x - lse[bb, hh, i])
                out[bb, i, hh] = w @ v[bb, js, kv] if len(js) else 0.0
    return out, lse


CASES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=True, window=(3, -1)),
    "window two-sided": dict(causal=False, window=(2, 3)),
    "packed": dict(causal=True, cu_seqlens=(0, 4, 9)),
    "cross": dict(causal=True, nk=13),
    "cross packed": dict(causal=True, cu_seqlens=(0, 4, 9), cu_seqlens_k=(0, 7, 13)),
}


def _small(rng, case, b=2, h=4, hkv=2, d=5):
    nq = 9
    nk = CASES[case].get("nk", 13 if "cu_seqlens_k" in CASES[case] else nq)
    q, k, v = random_qkv(rng, nq, h, hkv, d, batch=b, realistic=True, nk=nk)
    mask = {x: y for x, y in CASES[case].items() if x not in ("causal", "nk")}
    return q, k, v, CASES[case]["causal"], mask


MODS = {
    "alibi": dict(alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=(0.5, -1.0, 2.0, 30.0)),
    "all": dict(alibi_slopes=(0.3, 0.0, 1.0, 0.01), softcap=2.0, sinks=(1.0, 0.0, -2.0, 0.5)),
}


def _formula_kw(mask, mods):
    return dict(
        cu_q=mask.get("cu_seqlens"),
        cu_k=mask.get("cu_seqlens_k", mask.get("cu_seqlens")),
        window=mask.get("window"),
        slopes=mods.get("alibi_slopes"),
        cap=mods.get("softcap"),
        sinks=mods.get("sinks"),
    )


@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_formula(rng, case, mods):
    q, k, v, causal, mask = _small(rng, case)
    out, lse = reference.attention(q, k, v, causal, 0.4, **mask, **MODS[mods])
    f_out, f_lse = _formula(q, k, v, causal, 0.4, **_formula_kw(mask, MODS[mods]))
    assert np.abs(out - f_out).max() < 1e-13
    assert np.array_equal(np.isinf(lse), np.isinf(f_lse))
    fin = np.isfinite(f_lse)
    assert np.abs(lse[fin] - f_lse[fin]).max() < 1e-13


def test_row_without_keys_with_sink(rng):
    """A row that sees no key: out 0, lse = its head's sink (-inf without sinks)."""
    q, k, v = random_qkv(rng, 6, 2, 1, 4, realistic=True)
    win = dict(window=(0, 0), cu_seqlens=(0, 3, 6), cu_seqlens_k=(0, 0, 6))
    out, lse = reference.attention(q, k[:6], v[:6], True, sinks=(1.5, -0.5), **win)
    assert np.array_equal(out[:3], np.zeros_like(out[:3]))
    assert np.array_equal(lse[:, :3], [[1.5] * 3, [-0.5] * 3])
    _, lse0 = reference.attention(q, k[:6], v[:6], True, **win)
    assert np.isneginf(lse0[:, :3]).all()


def _loss(q, k, v, dout, causal, mask, mods):
    out, _ = _formula(q, k, v, causal, 0.4, **_formula_kw(mask, mods))
    return float(np.sum(out * dout))


@pytest.mark.parametrize("case", ["causal", "window two-sided", "cross packed"])
def test_reference_backward_matches_finite_differences(rng, case):
    """dq, dk, dv and dsinks of the reference vs central differences of the formula."""
    q, k, v, causal, mask = _small(rng, case, b=1, h=2, hkv=1, d=3)
    mods = dict(alibi_slopes=(0.3, 0.1), softcap=1.2, sinks=(0.7, -0.3))
    dout = rng.standard_normal(q.shape) + 0.5
    dq, dk, dv, dsinks = reference.attention_backward(dout, q, k, v, causal, 0.4, **mask, **mods)
    eps = 1e-6
    for name, x, g in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            x[idx] += eps
            up = _loss(q, k, v, dout, causal, mask, mods)
            x[idx] -= 2 * eps
            down = _loss(q, k, v, dout, causal, mask, mods)
            x[idx] += eps
            num[idx] = (up - down) / (2 * eps)
        assert np.abs(g - num).max() < 1e-7 * max(1.0, np.abs(num).max()), name
    sinks = np.array(mods["sinks"])
    num = np.zeros(2)
    for hh in range(2):
        for sign in (1, -1):
            s2 = sinks.copy()
            s2[hh] += sign * eps
            num[hh] += sign * _loss(q, k, v, dout, causal, mask, {**mods, "sinks": s2})
    num /= 2 * eps
    assert np.abs(dsinks - num).max() < 1e-7 * max(1.0, np.abs(num).max())
    assert np.abs(dsinks).min() > 1e-3  # the check is not vacuous


def _ring_tiles(q, k, v, causal, scale, mask_kw, mods, size, layout, dtype, dout=None):
    """Every rank's numpy tile calls in one process: global (out, lse) or (dq, dk, dv, dsinks)."""
    b, nq, h, d = q.shape
    nk = k.shape[1]
    mask = make_mask(nq, nk, causal, **mask_kw)
    cu_q, cu_k = mask.cu_q, mask.cu_k
    slopes = mods.get("alibi_slopes")
    sinks = mods.get("sinks")
    kw = dict(scale=d**-0.5 if scale is None else scale, causal=causal, softcap=mods.get("softcap"))
    cd = numpy_tile.compute_dtype(dtype)
    out = np.zeros(q.shape)
    lse = np.zeros((b, h, nq))
    grads = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)]
    ref_out, ref_lse = reference.attention(q, k, v, causal, scale, **mask_kw, **mods)
    for r in range(size):
        qp = ringmpi.positions(nq, r, size, layout, cu_seqlens=cu_q)
        qi = np.ascontiguousarray(np.moveaxis(q[:, qp], 1, 2)).astype(cd)
        alibi = (
            None if slopes is None else (np.asarray(slopes, np.float64), mask.alibi_positions(qp))
        )
        bounds = None if mask.plain else mask.bounds(qp)
        acc, m, l = softmax.init_state(qi.shape, cd)
        blocks = []
        for src in range(size):
            kp = ringmpi.positions(nk, src, size, layout, cu_seqlens=cu_k)
            ki = np.ascontiguousarray(np.moveaxis(k[:, kp], 1, 2)).astype(cd)
            vi = np.ascontiguousarray(np.moveaxis(v[:, kp], 1, 2)).astype(cd)
            blocks.append((kp, ki, vi))
            numpy_tile.forward_tile(qi, ki, vi, qp, kp, acc, m, l, bounds=bounds, alibi=alibi, **kw)
        if sinks is not None:  # what backend.finish does with sinks
            sk = np.asarray(sinks, cd)[None, :, None]
            m_new = np.maximum(m, sk)
            l = l * np.exp(m - m_new) + np.exp(sk - m_new)
            acc = acc * np.exp(m - m_new)[..., None]
            m = m_new
        o, ls = softmax.finalize(acc, m, l)
        out[:, qp] = np.moveaxis(o, 1, 2)
        lse[..., qp] = ls
        if dout is None:
            continue
        doi = np.ascontiguousarray(np.moveaxis(dout[:, qp], 1, 2)).astype(cd)
        delta = np.sum(doi * o, axis=-1)
        dq = np.zeros_like(qi)
        for kp, ki, vi in blocks:
            dk, dv = np.zeros_like(ki), np.zeros_like(vi)
            numpy_tile.backward_tile(
                qi, ki, vi, doi, ls, delta, qp, kp, dq, dk, dv, bounds=bounds, alibi=alibi, **kw
            )
            grads[1][:, kp] += np.moveaxis(dk, 1, 2)
            grads[2][:, kp] += np.moveaxis(dv, 1, 2)
        grads[0][:, qp] = np.moveaxis(dq, 1, 2)
        if sinks is not None:
            grads.append(-(np.exp(np.asarray(sinks)[None, :, None] - ls) * delta).sum(axis=(0, 2)))
    if dout is None:
        return out, lse
    if sinks is not None:
        dsinks = sum(grads[3:])
        return (*grads[:3], dsinks)
    return tuple(grads)


TILE_CASES = {
    "causal": (dict(), True, 700, 700),
    "window": (dict(window=(40, 0)), True, 700, 700),
    "packed": (dict(cu_seqlens=(0, 300, 301, 700)), True, 700, 700),
    "cross": (dict(), True, 300, 700),
    "cross packed": (dict(cu_seqlens=(0, 100, 300), cu_seqlens_k=(0, 350, 700)), True, 300, 700),
    "full window": (dict(window=(30, 20)), False, 700, 700),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("case", list(TILE_CASES))
def test_numpy_tile_forward_backward(rng, case, layout, dtype):
    """The numpy tiles with every modifier over a simulated ring of 3, vs the reference."""
    mask_kw, causal, nq, nk = TILE_CASES[case]
    q, k, v = random_qkv(rng, nq, 4, 2, 16, batch=1, realistic=True, nk=nk)
    dout = 0.3 + rng.standard_normal(q.shape)
    mods = dict(alibi_slopes=(0.5, 0.125, 0.03125, 0.0), softcap=3.0, sinks=(1.0, -2.0, 0.5, 4.0))
    q, k, v, dout = (x.astype(dtype).astype(np.float64) for x in (q, k, v, dout))
    out, lse = _ring_tiles(q, k, v, causal, None, mask_kw, mods, 3, layout, dtype)
    ref, ref_lse = reference.attention(q, k, v, causal, **mask_kw, **mods)
    grads = _ring_tiles(q, k, v, causal, None, mask_kw, mods, 3, layout, dtype, dout)
    ref_g = reference.attention_backward(dout, q, k, v, causal, **mask_kw, **mods)
    if dtype == np.float64:
        peer, peer_g = (None, None), (None,) * 4
    else:
        peer = dense(q, k, v, causal, **mask_kw, **mods)
        peer_g = dense_backward(dout, q, k, v, causal, **mask_kw, **mods)
    tag = f"{case} {layout} {np.dtype(dtype)}"
    assert_close(None, out, ref, peer[0], f"{tag} out")
    assert_close(None, lse, ref_lse, peer[1], f"{tag} lse")
    for name, g, rg, pg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_g, peer_g):
        assert_close(None, g, rg, pg, f"{tag} {name}", factor=3.0)


def test_numpy_tile_modifiers_change_the_result(rng):
    """Each modifier moves the output well beyond the tolerance (the tests above can fail)."""
    q, k, v = random_qkv(rng, 200, 2, 1, 8, batch=1, realistic=True)
    plain, _ = _ring_tiles(q, k, v, True, None, {}, {}, 2, "zigzag", np.float64)
    for mods in (dict(alibi_slopes=(0.1, 0.01)), dict(softcap=0.5), dict(sinks=(3.0, 3.0))):
        got, _ = _ring_tiles(q, k, v, True, None, {}, mods, 2, "zigzag", np.float64)
        assert np.abs(got - plain).max() > 1e-3, mods


def _flash_convention(q, k, v, causal, slopes, cap):
    """FlashAttention's reference conventions (tests/test_flash_attn.py attention_ref and
    attn_bias_from_alibi_slopes), restated in numpy: softcap right after the scale, then
    the alibi bias -slope * |i + Lk - Lq - j| (causal: slope * (j - (Lk - 1)), which
    differs from it by a per-row constant), then the causal mask (bottom-right)."""
    nq, nk, h, d = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
    g = h // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q / np.sqrt(d), kk)
    if cap:
        s = np.tanh(s / cap) * cap
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    sl = np.asarray(slopes)[:, None, None]
    s = s + (sl * (j - (nk - 1)) if causal else -sl * np.abs(i + nk - nq - j))
    if causal:
        s = np.where(j <= i + nk - nq, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, vv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(50, 50), (20, 50)])
def test_reference_follows_flash_attention_conventions(rng, causal, nq, nk):
    """Softcap and ALiBi as FlashAttention's own reference defines them (cross: bottom-right)."""
    q, k, v = random_qkv(rng, nq, 4, 2, 8, realistic=True, nk=nk)
    slopes, cap = (0.5, 0.25, 0.125, 0.0625), 1.7
    out, _ = reference.attention(q, k, v, causal, alibi_slopes=slopes, softcap=cap)
    want = _flash_convention(q, k, v, causal, slopes, cap)
    assert np.abs(out - want).max() < 1e-13


def test_spec_fields_validate_and_round_trip():
    """AttentionSpec: arrays normalise to tuples, attributes round-trip, bad values raise."""
    spec = ringmpi.AttentionSpec(
        alibi_slopes=np.array([0.5, 0.25], np.float32), softcap=np.float64(30), sinks=[1, -2]
    ).validate()
    assert spec.alibi_slopes == (0.5, 0.25) and spec.sinks == (1.0, -2.0)
    assert spec.softcap == 30.0 and isinstance(spec.softcap, float)
    attrs = spec.to_attrs()
    assert attrs["alibi_slopes"] == [0.5, 0.25] and attrs["softcap"] == 30.0
    assert ringmpi.AttentionSpec.from_attrs(attrs) == spec
    assert ringmpi.AttentionSpec.from_attrs({k: np.asarray(x) for k, x in attrs.items()}) == spec
    assert "sinks" not in ringmpi.AttentionSpec().to_attrs()
    spec.check_heads(2)
    with pytest.raises(ValueError, match="alibi_slopes has 2 values but q has H=4"):
        spec.check_heads(4)
    for bad, word in (
        (dict(softcap=0), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(softcap=[1.0]), "softcap"),
        (dict(sinks=[]), "sinks"),
        (dict(sinks=["a"]), "sinks"),
        (dict(alibi_slopes=[np.nan]), "alibi_slopes"),
        (dict(alibi_slopes=np.ones((2, 2))), "alibi_slopes"),
    ):
        with pytest.raises(ValueError, match=word):
            ringmpi.AttentionSpec(**bad).validate()
    with pytest.raises(ValueError, match="not both"):
        ringmpi.AttentionSpec.of(spec, softcap=2.0)


def test_backend_supports_names_missing_modifiers():
    """A backend whose tiles lack a modifier lists it (forward and backward separately)."""
    import dataclasses

    from ringmpi import backend

    be = backend._numpy_backend()
    spec = ringmpi.AttentionSpec(softcap=2.0, alibi_slopes=(0.1,), sinks=(0.0,)).validate()
    assert be.supports(spec, np.float32, 16) == []
    assert be.supports(spec, np.float32, 16, backward=True) == []
    part = dataclasses.replace(be, forward_mods=("softcap",), backward_mods=())
    why = part.supports(spec, np.float32, 16)
    assert len(why) == 1 and "alibi_slopes" in why[0] and "forward tile" in why[0]
    why = part.supports(spec, np.float32, 16, backward=True)
    assert len(why) == 2 and all("backward tile" in w for w in why)
    assert part.supports(spec, np.float32, 16, tiles=False) == []  # decode: no tiles
    sinks_only = ringmpi.AttentionSpec(sinks=(1.0,)).validate()
    assert dataclasses.replace(be, forward_mods=()).supports(sinks_only, np.float32, 16) == []


def test_serial_api_with_modifiers(monkeypatch, rng):
    """ring_attention on one rank (numpy tiles) with every modifier, and its backward."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    q, k, v = random_qkv(rng, 157, 4, 2, 8, realistic=True)
    dout = rng.standard_normal(q.shape)
    mods = dict(alibi_slopes=np.array([0.3, 0.1, 0.0, 1.0]), softcap=2.5, sinks=[0.5, 1, 2, 3])
    out, lse = ringmpi.ring_attention(q, k, v, causal=True, return_lse=True, **mods)
    ref, ref_lse = reference.attention(q, k, v, True, **mods)
    assert np.abs(out - ref).max() < 1e-12 and np.abs(lse - ref_lse).max() < 1e-12
    got = ringmpi.ring_attention_backward(dout, q, k, v, out, lse, causal=True, **mods)
    want = reference.attention_backward(dout, q, k, v, True, **mods)
    assert len(got) == 4
    for g, w in zip(got, want):
        assert np.abs(g - w).max() < 1e-11 * max(1.0, np.abs(w).max())
    plain = ringmpi.ring_attention_backward(dout, q, k, v, *reference.attention(q, k, v, True))
    assert len(plain) == 3  # no dsinks without sinks
