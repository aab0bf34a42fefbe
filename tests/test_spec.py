"""AttentionSpec: its rules, its normal form, its attribute round trip, and the public calls."""

import dataclasses

import numpy as np
import pytest

from ringmpi.mask import make_mask, mask_of
from ringmpi.spec import AttentionSpec

CU = (0, 3, 260, 261, 400)


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(),
        AttentionSpec(causal=True, layout="striped", scale=0.125),
        AttentionSpec(window=(64, 0), cu_seqlens=CU, head_parallel=2),
        AttentionSpec(cu_seqlens=CU, cu_seqlens_k=(0, 5, 300, 301, 500), layout="contiguous"),
        AttentionSpec(causal=True, layout="balanced"),  # issue 41: dealt by the mask's cost
    ],
)
def test_attrs_round_trip(tmp_path, spec):
    """to_attrs -> from_attrs gives an equal spec, also through an HDF5 file's attributes."""
    h5py = pytest.importorskip("h5py")
    s = spec.validate()
    attrs = s.to_attrs()
    assert AttentionSpec.from_attrs(attrs) == s
    assert all(v is not None for v in attrs.values())
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.attrs.update(attrs)
        f.attrs["unrelated"] = 7  # other attributes of the file are ignored
    with h5py.File(tmp_path / "a.h5", "r") as f:
        back = AttentionSpec.from_attrs(f.attrs)
    assert back == s and hash(back) == hash(s)
    # a field changed is a different spec (what a resume fingerprint relies on)
    other = dataclasses.replace(s, causal=not s.causal)
    assert AttentionSpec.from_attrs(other.to_attrs()) != s


def test_validate_normal_form():
    s = AttentionSpec(
        causal=1, window=np.array([5, -1]), cu_seqlens=np.array([0, 4, 9]), scale=np.float32(0.5)
    ).validate()
    assert s == AttentionSpec(causal=True, window=(5, -1), cu_seqlens=(0, 4, 9), scale=0.5)
    assert type(s.scale) is float and all(type(x) is int for x in s.cu_seqlens)
    assert s.validate() == s
    assert AttentionSpec(window=(-1, -1)).validate().window is None
    assert AttentionSpec().scale_for(64) == 0.125 and s.scale_for(64) == 0.5


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(window=(3, -5)), "window"),
        (dict(window=(1.5, 0)), "window"),
        (dict(window="ab"), "window"),
        (dict(cu_seqlens=[0, 5, 3]), "cu_seqlens"),
        (dict(cu_seqlens=[1, 5]), "cu_seqlens"),
        (dict(cu_seqlens=[[0, 5]]), "cu_seqlens"),
        (dict(cu_seqlens=[0.0, 5.0]), "cu_seqlens"),
        (dict(cu_seqlens_k=[0, 5]), "needs cu_seqlens"),
        (dict(cu_seqlens=[0, 5, 9], cu_seqlens_k=[0, 5]), "sequences"),
        (dict(scale="x"), "scale"),
        (dict(scale=float("inf")), "scale"),
        (dict(layout="spiral"), "layout"),
        (dict(head_parallel=0), "head_parallel"),
        (dict(head_parallel=2.0), "head_parallel"),
        (dict(head_parallel=True), "head_parallel"),
    ],
)
def test_validate_rejects(kw, word):
    with pytest.raises(ValueError, match=word):
        AttentionSpec(**kw).validate()


def test_mask_checks_lengths_and_matches_make_mask():
    s = AttentionSpec(causal=True, window=(50, 0), cu_seqlens=CU)
    m = mask_of(s, 400, 400)
    ref = make_mask(400, 400, True, (50, 0), np.array(CU))
    pos = np.arange(400)
    for a, b in zip(m.bounds(pos), ref.bounds(pos)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="N=401"):
        mask_of(s, 401, 401)
    assert mask_of(AttentionSpec(causal=True), 10, 10).plain


def test_of_builds_or_passes_through():
    s = AttentionSpec(causal=True)
    assert AttentionSpec.of(None, causal=True, layout="zigzag") == s
    assert AttentionSpec.of(s, causal=False, layout="zigzag", window=None) is s
    with pytest.raises(ValueError, match="causal"):
        AttentionSpec.of(AttentionSpec(), causal=True)
    with pytest.raises(ValueError, match="window"):
        AttentionSpec.of(AttentionSpec(), window=(3, 3))
    with pytest.raises(TypeError, match="AttentionSpec"):
        AttentionSpec.of({"causal": True})
