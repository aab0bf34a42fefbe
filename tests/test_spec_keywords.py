"""The score-modifier keywords of the public functions come from the spec's fields."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi import reference
from ringmpi import spec as keywords
from ringmpi.spec import modifier_fields

PUBLIC = (ringmpi.ring_attention, ringmpi.ring_attention_backward, ringmpi.decode_attention)
NAMES = [name for name, _ in modifier_fields()]


def test_the_modifier_fields_are_the_three_of_the_api():
    assert NAMES == ["alibi_slopes", "softcap", "sinks"]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_every_public_function_takes_every_modifier(fn):
    params = inspect.signature(fn).parameters
    for name in NAMES:
        p = params[name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None
    # the private seams stay last
    names = list(params)
    assert all(names.index(n) < names.index(p) for n in NAMES for p in names if p[0] == "_")
    doc = fn.__doc__
    assert keywords.PLACEHOLDER not in doc
    for name, meta in modifier_fields():
        assert f"    {name} : {meta['kind']}" in doc
    with pytest.raises(TypeError, match="unexpected keyword argument 'softcapp'"):
        fn(None, None, None, softcapp=1.0)


def test_a_new_modifier_field_is_a_keyword_with_no_other_edit(monkeypatch):
    extra = ("temperature", {"kind": "float, optional", "doc": "A dummy.", "tile": True})
    monkeypatch.setattr(keywords, "modifier_fields", lambda: modifier_fields() + [extra])

    def f(q, *, causal=False, _private=None, **modifiers):
        """Doc.

        Parameters
        ----------
        {modifiers}
        """
        return modifiers

    g = keywords.spec_keywords(f)
    assert list(inspect.signature(g).parameters) == [
        "q",
        "causal",
        *NAMES,
        "temperature",
        "_private",
    ]
    assert g(1, temperature=2.0) == {"temperature": 2.0}
    assert "        temperature : float, optional\n            A dummy." in g.__doc__


def test_modifier_keywords_reach_the_call():
    rng = np.random.default_rng(4)
    q = 0.3 + rng.standard_normal((40, 2, 16))
    k = 0.5 + 0.1 * rng.standard_normal((40, 1, 16))
    v = 1.0 + 0.1 * rng.standard_normal((40, 1, 16))
    slopes, sinks = np.array([0.25, 0.0625]), np.array([0.5, -1.0])
    mods = dict(softcap=5.0, alibi_slopes=slopes, sinks=sinks)
    out, lse = ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, causal=True, return_lse=True, **mods)
    ref_o, ref_l = reference.attention(q, k, v, causal=True, **mods)
    assert np.abs(out - ref_o).max() < 1e-12 and np.abs(lse - ref_l).max() < 1e-12


def test_decode_refuses_what_it_does_not_apply():
    q = np.zeros((1, 2, 8))
    k = v = np.zeros((4, 1, 8))
    with pytest.raises(ValueError, match="alibi_slopes needs token positions"):
        ringmpi.decode_attention(q, k, v, MPI.COMM_SELF, alibi_slopes=np.ones(2))
