"""apply_rope: a rotation (norms kept) whose scores depend on relative position only."""

import numpy as np
import pytest

from ringmpi.rope import apply_rope, rope_angles


def _x(s=64, h=3, d=16, seed=0):
    return np.random.default_rng(seed).standard_normal((s, h, d))


def test_rotation_preserves_pair_norms():
    x = _x()
    pos = np.arange(1000, 1064)
    y = apply_rope(x, pos, theta=500.0, scale=2.0)
    half = x.shape[-1] // 2
    pair = lambda a: a[..., :half] ** 2 + a[..., half:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair(y), pair(x), rtol=1e-12, atol=1e-12)
    assert np.abs(y - x).max() > 0.1  # it did rotate


def test_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((1, 2, 32)), rng.standard_normal((1, 2, 32))

    def score(i, j):
        a = apply_rope(q, np.array([i]))
        b = apply_rope(k, np.array([j]))
        return np.einsum("shd,shd->h", a, b)

    # angles up to ~2e3 rad: float64 rounding of the angle stays below 1e-12 in the score
    for i, j, t in [(5, 2, 7), (0, 300, 1234), (700, 17, 1000)]:
        np.testing.assert_allclose(score(i + t, j + t), score(i, j), rtol=0, atol=1e-12)
    assert np.abs(score(5, 2) - score(5, 3)).max() > 1e-3  # positions matter


def test_position_zero_is_identity_and_convention_is_rotate_half():
    x = _x(s=2, h=1, d=4)
    np.testing.assert_array_equal(apply_rope(x, np.zeros(2, int)), x)
    # rotate-half: features (0, 2) and (1, 3) rotate as complex numbers x_i + i x_{i+D/2}
    pos = np.array([3, 11])
    y = apply_rope(x, pos, theta=100.0, scale=4.0)
    ang = (pos / 4.0)[:, None] * 100.0 ** (-np.arange(2) * 2 / 4)
    z = (x[:, 0, :2] + 1j * x[:, 0, 2:]) * np.exp(1j * ang)
    np.testing.assert_allclose(y[:, 0, :2], z.real, atol=1e-14)
    np.testing.assert_allclose(y[:, 0, 2:], z.imag, atol=1e-14)


def test_scale_interpolates_positions_and_dtype_is_kept():
    x = _x(s=8).astype(np.float32)
    pos = np.arange(8) * 3
    np.testing.assert_array_equal(apply_rope(x, pos, scale=3.0), apply_rope(x, pos // 3))
    assert apply_rope(x, pos).dtype == np.float32
    assert rope_angles(pos, 16).shape == (8, 8)


@pytest.mark.parametrize(
    "kw, match",
    [({"d": 15}, "even head dimension"), ({"theta": 0.0}, "theta"), ({"scale": -1.0}, "scale")],
)
def test_bad_arguments(kw, match):
    x = _x(s=4, d=kw.pop("d", 16))
    with pytest.raises(ValueError, match=match):
        apply_rope(x, np.arange(4), **kw)


def test_positions_must_match_tokens():
    with pytest.raises(ValueError, match="positions has shape"):
        apply_rope(_x(s=4), np.arange(5))
