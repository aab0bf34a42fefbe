"""ringmpi.slices: the value type, its normal form, the builders, and how the mask code uses it."""

import pickle

import numpy as np
import pytest
from tools.slicecases import KINDS, builder_cases, dense_of, random_slices

import ringmpi
from ringmpi import cost
from ringmpi.mask import make_mask, mask_of, plan_steps
from ringmpi.slices import Slices, block_sparse, global_local, prefix_lm, shared_prefix
from ringmpi.spec import AttentionSpec


def test_each_kind_follows_its_definition():
    # a 4 x 6 slice (Lk - Lq = 2) at an offset, so that alignment errors show
    for kind in KINDS:
        s = Slices([(3, 7, 10, 16, kind)])
        got = s.to_dense(9, 17)[3:7, 10:16].astype(int)
        want = {
            "full": np.ones((4, 6), int),
            "causal": np.array([[j <= i + 2 for j in range(6)] for i in range(4)], int),
            "inv_causal": np.array([[j >= i for j in range(6)] for i in range(4)], int),
            "bi_causal": np.array([[i <= j <= i + 2 for j in range(6)] for i in range(4)], int),
        }[kind]
        assert (got == want).all(), kind
        assert s.to_dense(9, 17).sum() == want.sum()  # nothing outside the rectangle


def test_causal_with_fewer_keys_hides_the_first_rows():
    d = Slices([(0, 5, 0, 3, "causal")]).to_dense(5, 3)
    assert not d[:2].any() and d[2:].sum() == 1 + 2 + 3


@pytest.mark.parametrize("seed", range(12))
def test_normal_form_is_the_union(seed):
    rng = np.random.default_rng(seed)
    nq, nk = int(rng.integers(1, 60)), int(rng.integers(1, 60))
    raw = random_slices(rng, nq, nk, int(rng.integers(0, 9)))
    s = Slices(raw)
    want = dense_of(raw, nq, nk)
    assert (s.to_dense(nq, nk) == want).all()
    lo, hi = s.row_intervals(np.arange(nq))
    assert lo.shape == hi.shape and lo.shape[1] == nq and lo.dtype == np.int64
    got = np.zeros_like(want)
    j = np.arange(nk)
    for t in range(lo.shape[0]):
        got |= (lo[t][:, None] <= j) & (j <= hi[t][:, None])
        real = lo[t] <= hi[t]
        if t:  # sorted, disjoint and not touching the previous interval; padding only at the end
            prev_real = lo[t - 1] <= hi[t - 1]
            assert (lo[t][real] > hi[t - 1][real] + 1).all() and prev_real[real].all()
    assert (got == want).all()
    assert s.pairs(nq) == want.sum()
    # any order of the rows, any subset
    perm = rng.permutation(nq)[: max(1, nq // 2)]
    lo_p, hi_p = s.row_intervals(perm)
    nrows = len(perm)
    layers = lo_p.shape[0]
    assert layers <= lo.shape[0]
    assert (lo_p == lo[:layers, perm]).all() and (hi_p == hi[:layers, perm]).all() or nrows == 0


@pytest.mark.parametrize("seed", range(4))
def test_svg_draws_the_mask(seed):
    """Each visible pair is covered by exactly one filled square of the picture, nothing
    else is filled, and every slice has its outline."""
    import re
    import xml.etree.ElementTree as ET

    rng = np.random.default_rng(seed)
    nq, nk = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    raw = random_slices(rng, nq, nk, int(rng.integers(1, 7)))
    s = Slices(raw)
    svg = s.to_svg(nq, nk, cell=3, title="a <test> & more")
    root = ET.fromstring(svg)  # well-formed, the title escaped
    ns = "{http://www.w3.org/2000/svg}"
    assert root.find(f"{ns}title").text == "a <test> & more"
    assert int(root.get("width")) == 3 * nk + 2 and int(root.get("height")) == 3 * nq + 2
    fill, lines = root.findall(f"{ns}g")
    covered = np.zeros((nq, nk), int)
    for r in fill:
        x, y, w, h = (int(r.get(a)) for a in ("x", "y", "width", "height"))
        assert h == 3 and (x - 1) % 3 == 0 and (y - 1) % 3 == 0 and w % 3 == 0
        covered[(y - 1) // 3, (x - 1) // 3 : (x - 1 + w) // 3] += 1
    assert (covered == s.to_dense(nq, nk)).all()
    boxes = sorted(tuple(int(r.get(a)) for a in ("x", "y", "width", "height")) for r in lines)
    want = sorted(
        (1 + 3 * k0, 1 + 3 * q0, 3 * (k1 - k0), 3 * (q1 - q0))
        for q0, q1, k0, k1, _ in s
        if q0 < q1 and k0 < k1
    )
    assert boxes == want
    assert s.to_svg(nq, nk, cell=3, title="a <test> & more") == svg  # deterministic
    assert "stroke-dasharray" not in s.to_svg(nq, nk, outline=False)
    assert re.search(r"aria-label=\"Slices\(", s.to_svg(nq, nk))  # default title: the repr
    with pytest.raises(ValueError, match="beyond"):
        Slices([(0, 2, 0, 2, "full")]).to_svg(1, 1)
    with pytest.raises(ValueError, match="cell"):
        s.to_svg(nq, nk, cell=0)


def test_overlaps_count_once_and_touching_intervals_merge():
    s = Slices([(0, 4, 0, 5, "full"), (0, 4, 3, 8, "full"), (0, 4, 8, 9, "full")])
    lo, hi = s.row_intervals(np.arange(4))
    assert lo.tolist() == [[0] * 4] and hi.tolist() == [[8] * 4]
    assert s.pairs() == 4 * 9
    lo, hi = Slices([(0, 2, 0, 2, "full"), (0, 2, 5, 6, "full")]).row_intervals([0, 1, 7])
    assert lo.tolist() == [[0, 0, 0], [5, 5, 0]] and hi.tolist() == [[1, 1, -1], [5, 5, -1]]
    assert Slices().row_intervals([0, 1])[0].shape == (0, 2)


@pytest.mark.parametrize("n", [1, 17, 100])
def test_builders_match_their_rules(n):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for name, s, rule in builder_cases(n):
        want = np.broadcast_to(rule(i, j), (n, n))
        assert (s.to_dense(n, n) == want).all(), name
        assert (dense_of(s, n, n) == want).all(), name
        assert s.pairs(n) == want.sum(), name
        assert s.extent[0] <= n and s.extent[1] <= n, name


def test_block_sparse_random_is_seeded_and_keeps_the_diagonal():
    a, b = block_sparse(100, 10, seed=3), block_sparse(100, 10, seed=3)
    assert a == b and a != block_sparse(100, 10, seed=4)
    d = a.to_dense(100, 100)
    assert d[np.arange(100), np.arange(100)].all()
    assert 0.1 < d.mean() < 0.6
    assert block_sparse(100, 10, density=0.0, seed=1).pairs() == 10 * 100
    c = block_sparse(95, 10, seed=3, causal=True).to_dense(95, 95)
    assert not np.triu(c, 1).any() and c[np.arange(95), np.arange(95)].all()


def test_existing_masks_are_special_cases():
    n = 50
    assert (Slices([(0, n, 0, n, "causal")]).to_dense(n, n) == np.tril(np.ones((n, n), bool))).all()
    i = np.arange(n)
    j = np.arange(n)[None, :]
    for window, causal in (((4, 2), False), ((6, 0), True), ((-1, 3), False), ((5, -1), False)):
        lo, hi = make_mask(n, n, causal, window).bounds(i)
        want = (lo[:, None] <= j) & (j <= hi[:, None])
        got = global_local(n, window, 0, causal=causal).to_dense(n, n)
        assert (got == want).all(), window


@pytest.mark.parametrize(
    "bad, words",
    [
        ([(0, 1, 0, 1)], "a slice is"),
        ([(0, 1, 0, 1, "diag")], "kind must be one of"),
        ([(0, 1.5, 0, 1, "full")], "integers"),
        ([(True, 1, 0, 1, "full")], "integers"),
        ([(2, 1, 0, 1, "full")], "q_start <= q_end"),
        ([(0, 1, -1, 1, "full")], "0 <= k_start"),
        (5, "iterable of slices"),
        ([7], "a slice is"),
    ],
)
def test_bad_slices_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        Slices(bad)


def test_builder_arguments_are_checked():
    for call, words in (
        (lambda: prefix_lm(10, 11), "prefix=11"),
        (lambda: prefix_lm(-1, 0), "n must be"),
        (lambda: global_local(10, 3, 11), "global_tokens=11"),
        (lambda: global_local(10, (1, 2, 3), 0), "window must be"),
        (lambda: global_local(10, (-2, 0), 0), "window must be"),
        (lambda: shared_prefix(3, 4), "answer_lens"),
        (lambda: shared_prefix(3, [2, -1]), "answer length"),
        (lambda: block_sparse(10, 0), "block must be"),
        (lambda: block_sparse(10, 3, np.ones((3, 3), bool)), r"bool \(4, 4\)"),
        (lambda: block_sparse(10, 3, density=2), "density"),
    ):
        with pytest.raises(ValueError, match=words):
            call()


def test_value_type():
    s = Slices([(2, 4, 0, 4, "causal"), (0, 2, 0, 2, 0), (0, 2, 0, 2, "full")])
    assert len(s) == 2 and s.slices[0] == (0, 2, 0, 2, "full")  # sorted, duplicates once
    assert s == Slices(list(reversed(list(s)))) and hash(s) == hash(Slices(s))
    assert Slices(s.table()) == s and Slices(s.table().tolist()) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert eval(repr(s), {"Slices": Slices}) == s
    assert s.extent == (4, 4)
    with pytest.raises(ValueError, match="reaches beyond"):
        s.check(4, 3)
    assert ringmpi.Slices is Slices


def test_spec_takes_slices_alone():
    s = prefix_lm(20, 5)
    spec = AttentionSpec(slices=list(s)).validate()
    assert spec.slices == s and spec.validate() == spec
    back = AttentionSpec.from_attrs(spec.to_attrs())
    assert back == spec
    for other in (dict(causal=True), dict(window=(3, 0)), dict(cu_seqlens=[0, 20])):
        with pytest.raises(ValueError, match="slices is the whole mask"):
            AttentionSpec(slices=s, **other).validate()
    with pytest.raises(ValueError, match="slices: .*kind"):
        AttentionSpec(slices=[(0, 1, 0, 1, "x")]).validate()
    with pytest.raises(ValueError, match="reaches beyond"):
        mask_of(spec, 19, 20)


def test_mask_of_slices_has_layers_not_bounds():
    s = Slices([(0, 10, 0, 2, "full"), (0, 5, 5, 10, "bi_causal")])
    mask = mask_of(AttentionSpec(slices=s), 10, 10)
    assert not mask.plain
    with pytest.raises(ValueError, match="use layers"):
        mask.bounds(np.arange(10))
    layers = mask.layers(np.arange(10))
    assert len(layers) == 2
    assert cost.mask_pairs(mask) == s.pairs(10) == dense_of(s, 10, 10).sum()


def test_plan_skips_steps_and_layers_nobody_needs():
    n, size = 120, 4
    # a causal window of 10 under the contiguous layout: each rank needs its own block
    # and the previous one only
    s = global_local(n, (10, 0), 0, causal=True)
    mask = mask_of(AttentionSpec(slices=s), n, n)
    total = 0
    for rank in range(size):
        plan = plan_steps(mask, rank, size, "contiguous")
        assert plan.nsteps == 2 and plan.bounds is None
        assert plan.compute == [True, rank > 0]
        for step in range(plan.nsteps):
            src = (rank - step) % size
            k_pos = ringmpi.positions(n, src, size, "contiguous")
            used = plan.layer_steps[step]
            assert all(mask.visible(*plan.layers[t], np.sort(k_pos)) for t in used)
            total += plan.pairs(step, k_pos, False)
    assert total == s.pairs(n)
    # only rank 0's queries see a key, of its own block: one step, no message
    own = Slices([(0, 30, 0, 30, "full")])
    for rank in range(size):
        plan = plan_steps(mask_of(AttentionSpec(slices=own), n, n), rank, size, "contiguous")
        assert plan.nsteps == 1 and plan.compute == [rank == 0]


def test_tile_at_calls_once_per_visible_layer():
    s = Slices([(0, 8, 0, 2, "full"), (0, 8, 6, 8, "full")])
    plan = plan_steps(mask_of(AttentionSpec(slices=s), 8, 8), 0, 1, "contiguous")
    calls = []

    def tile(*args, bounds=None, **kw):
        calls.append((bounds[0].tolist(), bounds[1].tolist()))
        return 1

    assert plan.tile_at(tile, 0)("q", scale=1.0) == 2
    assert calls == [([0] * 8, [1] * 8), ([6] * 8, [7] * 8)]
    assert plan.pairs(0, np.arange(8), False) == 8 * 4
    # the single-range masks keep their own path: the tile itself, unwrapped
    for spec in (AttentionSpec(causal=True), AttentionSpec(window=(3, 0))):
        plan = plan_steps(mask_of(spec, 8, 8), 0, 1, "zigzag")
        assert plan.tile_at(tile, 0) is tile and plan.layers is None


def test_spec_attributes_are_json_and_hdf5_friendly(tmp_path):
    import json

    h5py = pytest.importorskip("h5py")
    spec = AttentionSpec(slices=shared_prefix(4, [2, 3])).validate()
    attrs = spec.to_attrs()
    assert AttentionSpec.from_attrs(json.loads(json.dumps(attrs))) == spec
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.attrs.update(attrs)
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert AttentionSpec.from_attrs(f.attrs) == spec
