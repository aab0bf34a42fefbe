"""The score-modifier registry and parameter block (ringmpi.scoremods) against float64 formulas."""

from __future__ import annotations

import numpy as np
import pytest

from ringmpi import scoremods
from ringmpi.spec import AttentionSpec

H, SQ, NK = 4, 9, 13


def _data(seed=0):
    rng = np.random.default_rng([seed, 25])
    # scores shaped like real ones: a mean, a small spread, a few huge values
    s = 3.0 + 0.5 * rng.standard_normal((2, H, SQ, NK))
    s[0, 1, 2, 3] = 400.0
    qa = np.arange(SQ, dtype=np.int64) * 3 + 40
    kp = np.arange(NK, dtype=np.int64) * 5
    slopes = 2.0 ** -np.arange(1, H + 1)
    return s, qa, kp, slopes


def test_pack_builds_the_block_in_slot_order():
    _, qa, _, slopes = _data()
    m = scoremods.pack({"alibi": (slopes, qa), "softcap": 30.0}, H, SQ)
    assert m.bits == 0b11
    assert m.params.shape == (H, scoremods.NMODS) and m.params.dtype == np.float64
    assert m.params.flags.c_contiguous
    np.testing.assert_array_equal(m.params[:, 0], 30.0)
    np.testing.assert_array_equal(m.params[:, 1], slopes)
    np.testing.assert_array_equal(m.qpos, qa)
    assert [x.field for x in m.active()] == ["softcap", "alibi_slopes"]
    back = scoremods.pack(m.keywords(), H, SQ)
    assert back.bits == m.bits and np.array_equal(back.params, m.params)
    assert scoremods.pack({}, H, SQ) is None and scoremods.pack({"softcap": None}, H, SQ) is None
    assert scoremods.names()[:2] == ("softcap", "alibi_slopes")  # slot order
    assert [m.slot for m in sorted(scoremods.MODS, key=lambda m: m.slot)] == list(
        range(len(scoremods.MODS))
    )


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"softcap": -1.0}, ValueError, "softcap must be a finite number > 0"),
        ({"softcap": float("nan")}, ValueError, "softcap must be a finite number > 0"),
        ({"softcap": [1.0, 2.0]}, ValueError, "softcap must be a finite number > 0"),
        ({"alibi": (np.ones(3), np.arange(SQ))}, ValueError, "4 finite numbers"),
        ({"alibi": (np.array([1, np.inf, 0, 0]), np.arange(SQ))}, ValueError, "finite"),
        ({"alibi": np.ones(H)}, ValueError, "must be a pair"),
        ({"alibi": (np.ones(H), np.arange(SQ - 1))}, ValueError, r"shape \(9,\)"),
        ({"alibi": (np.ones(H), np.arange(SQ) + 0.5)}, ValueError, "integer array"),
        ({"bias": 1.0}, TypeError, "unknown score modifier keyword 'bias'"),
    ],
)
def test_pack_refuses_bad_values(kw, err, match):
    with pytest.raises(err, match=match):
        scoremods.pack(kw, H, SQ)


def test_apply_matches_float64_formula_and_derivative():
    s, qa, kp, slopes = _data()
    cap = 20.0
    m = scoremods.pack({"softcap": cap, "alibi": (slopes, qa)}, H, SQ)
    got = s.copy()
    factor = scoremods.apply(got, m, None, kp, (H,))
    dist = np.abs(qa[:, None] - kp[None, :])
    want = cap * np.tanh(s / cap) - slopes[:, None, None] * dist
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-12)
    assert abs(got[0, 1, 2, 3] - (cap - slopes[1] * dist[2, 3])) < 1e-9  # the huge score capped
    # the derivative against a central difference of the same map
    e = 1e-6
    hi, lo = s + e, s - e
    scoremods.apply(hi, m, None, kp, (H,))
    scoremods.apply(lo, m, None, kp, (H,))
    np.testing.assert_allclose(factor, (hi - lo) / (2 * e), rtol=1e-6, atol=1e-9)
    # ALiBi alone has derivative 1: no factor
    only = scoremods.pack({"alibi": (slopes, qa)}, H, SQ)
    assert scoremods.apply(s.copy(), only, None, kp, (H,)) is None
    assert scoremods.apply(s.copy(), None, None, kp, (H,)) is None


def test_apply_grouped_heads_and_float32():
    """(B, Hkv, G, n, nk) scores (the numpy tile's view, head h = hkv * G + g) in float32."""
    s, qa, kp, slopes = _data(1)
    m = scoremods.pack({"softcap": 7.5, "alibi": (slopes, qa)}, H, SQ)
    flat = s.astype(np.float32)
    grouped = flat.reshape(2, 2, 2, SQ, NK).copy()
    scoremods.apply(flat, m, None, kp, (H,))
    scoremods.apply(grouped, m, qa, kp, (2, 2))
    assert grouped.dtype == np.float32
    np.testing.assert_array_equal(grouped.reshape(flat.shape), flat)
    dist = np.abs(qa[:, None] - kp[None, :])
    want = 7.5 * np.tanh(s / 7.5) - slopes[:, None, None] * dist
    np.testing.assert_allclose(flat, want, rtol=3e-6, atol=3e-6)


def test_of_spec_and_tile_keywords():
    slopes = tuple(0.5 ** (i + 1) for i in range(H))
    spec = AttentionSpec(softcap=12.0, alibi_slopes=slopes, sinks=(0.0,) * H)
    m = scoremods.of_spec(spec, H, slice(1, 3))
    assert m.bits == 0b11 and m.qpos is None
    np.testing.assert_array_equal(m.params[:, 1], slopes[1:3])
    assert scoremods.of_spec({"softcap": 3.0}, H).params.shape == (H, scoremods.NMODS)
    assert scoremods.of_spec(AttentionSpec(), H) is None
    with pytest.raises(TypeError, match="sinks"):
        scoremods.of_spec({"sinks": (0.0,) * H}, H)
    qa = np.arange(SQ, dtype=np.int64)
    kw = scoremods.tile_keywords(spec, slice(2, 4), lambda: qa)
    assert kw["softcap"] == 12.0 and isinstance(kw["softcap"], float)
    np.testing.assert_array_equal(kw["alibi"][0], slopes[2:4])
    assert kw["alibi"][1] is qa
    called = []
    assert scoremods.tile_keywords(AttentionSpec(softcap=2.0), slice(None), called.append) == {
        "softcap": 2.0
    }
    assert not called  # positions are only computed for a position modifier


def test_backends_list_every_registered_modifier():
    """The fused backend's capabilities come from its builds' slots
    (tests/cpu/test_fused_modifiers.py checks the header and the builds against the registry)."""
    from ringmpi.backend import select

    be = select(np.zeros(1))
    assert set(be.forward_mods) == set(be.backward_mods) == set(scoremods.names())


def test_a_build_without_a_slot_refuses_it():
    from ringmpi.cpu.loader import check_mods

    m = scoremods.pack({"softcap": 3.0, "alibi": (np.ones(H), np.arange(SQ))}, H, SQ)
    check_mods(m, 0b11, "build")  # both implemented
    check_mods(None, 0, "build")  # nothing asked
    with pytest.raises(ValueError, match="without the score modifiers softcap$"):
        check_mods(m, 0b10, "build")
    assert scoremods.fields_of(0b10) == ("alibi_slopes",) and scoremods.fields_of(0) == ()
