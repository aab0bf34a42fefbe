"""Dealing a phase's batches to its rings by cost, and rank 0's index built ahead of the end."""

import glob
import os
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.job import run as rings
from ringmpi.job.input.scan import scan
from ringmpi.job.output.parts import OutputStore, fingerprint
from ringmpi.job.resources import make_batches
from ringmpi.job.run import deal


def _plan(lengths, d=64):
    seqs = [
        SimpleNamespace(name=f"s{i}", length=n, length_k=n, cu_seqlens=None, cu_seqlens_k=None)
        for i, n in enumerate(lengths)
    ]
    return SimpleNamespace(sequences=seqs, heads=4, kv_heads=2, head_dim=d, dtype="float32")


def _dealt(plan, lengths, nrings, head_start=0, cap=0):
    batches = make_batches(plan, list(range(len(lengths))), cap, nrings)
    return batches, deal(plan, batches, nrings, True, head_start=head_start)


@pytest.mark.parametrize("nrings", [1, 2, 3, 5])
def test_equal_batches_without_head_start_are_round_robin(nrings):
    lengths = [256] * 23
    plan = _plan(lengths)
    batches, out = _dealt(plan, lengths, nrings)
    assert out == [batches[r::nrings] for r in range(nrings)]


@pytest.mark.parametrize("nrings", [2, 3])
def test_every_batch_once_in_order_and_the_loads_even(nrings):
    rng = np.random.default_rng(5)
    lengths = [int(x) for x in np.clip(np.exp(5.5 + 1.2 * rng.standard_normal(300)), 16, 8192)]
    plan = _plan(lengths)
    batches, out = _dealt(plan, lengths, nrings, cap=16384)
    flat = [b for r in out for b in r]
    assert sorted(flat, key=lambda b: b.members) == batches  # each batch once
    for r in out:  # each ring keeps the phase's order
        assert [b.members for b in r] == sorted(b.members for b in r)
    cost = [_cost(plan, r) for r in out]
    biggest = max(_cost(plan, [b]) for b in batches)
    assert max(cost) - min(cost) <= biggest + 1e-12  # list scheduling: within one batch


def _cost(plan, batches):
    """The dealing's cost model of ``batches``, summed."""
    return sum(_one(plan, b) for b in batches)


def _one(plan, b):
    flops = sum(
        4.0 * plan.head_dim * plan.heads * s.length * (s.length + 1) / 2
        for s in (plan.sequences[i] for i in b.members)
    )
    row = plan.head_dim * 4
    nbytes = (b.length * 2 * plan.heads + b.length_k * 2 * plan.kv_heads) * row
    return (
        flops / rings.RATE["cpu"]
        + nbytes / rings.IO_BYTES_S
        + len(b.members) * rings.SEQ_S
        + rings.BATCH_S
    )


def test_head_start_moves_work_off_ring_zero():
    lengths = [256] * 400
    plan = _plan(lengths)
    _, plain = _dealt(plan, lengths, 2)
    _, ahead = _dealt(plan, lengths, 2, head_start=400)
    n0, n1 = (sum(len(b.members) for b in r) for r in ahead)
    assert n0 + n1 == 400 and n0 < n1
    # ring 0's batches plus the index cost what ring 1's do, to within one batch
    c0 = sum(_one(plan, b) for b in ahead[0]) + 400 * rings.INDEX_SEQ_S
    c1 = sum(_one(plan, b) for b in ahead[1])
    assert abs(c0 - c1) <= max(_one(plan, b) for b in ahead[1])
    assert len(plain[0]) >= len(ahead[0])


def test_a_head_start_longer_than_the_phase_leaves_ring_zero_nothing():
    lengths = [64] * 4
    plan = _plan(lengths, d=8)
    _, out = _dealt(plan, lengths, 2, head_start=10_000)
    assert out[0] == [] and len(out[1]) == 4


# -- the index built ahead --------------------------------------------------------------
S, H, HKV, D = 16, 2, 1, 8


def _store(tmp_path, n=4):
    paths = make_data(
        str(tmp_path / "in.h5"), seq_len=S, heads=H, kv_heads=HKV, head_dim=D, sequences=n
    )
    plan = scan(paths)
    st = OutputStore(
        str(tmp_path / "out.h5"), None, plan, fingerprint(plan, "zigzag", True, None, 1)
    )
    st.open(False)
    return st


def _write(st, members, rng):
    items, outs = [], {}
    for i in members:
        o = rng.standard_normal((S, H, D)).astype("f4")
        lse = rng.standard_normal((H, S)).astype("f4")
        items.append((i, np.arange(S), o, lse))
        outs[i] = (o, lse)
    st.write_batch(items)
    return outs


def _ahead_files(st):
    return glob.glob(os.path.join(st.parts, ".index.h5.*.tmp"))


def _check(st, outs):
    with h5py.File(st.path, "r") as f:
        for i, (o, lse) in outs.items():
            np.testing.assert_array_equal(f[f"seq00{i}"]["out"][...], o)
            np.testing.assert_array_equal(f[f"seq00{i}"]["lse"][...], lse)


def test_index_built_ahead_is_the_output(tmp_path):
    st = _store(tmp_path)
    st.build_ahead([((0, 1), 1), ((2,), 1), ((3,), 1)])  # before any part exists
    assert len(_ahead_files(st)) == 1 and not os.path.exists(st.path)
    rng = np.random.default_rng(0)
    outs = _write(st, (0, 1), rng)
    outs.update(_write(st, (2,), rng))
    outs.update(_write(st, (3,), rng))
    st.finish()
    assert _ahead_files(st) == []  # renamed into place
    _check(st, outs)


def test_index_built_for_other_batches_is_rebuilt(tmp_path):
    st = _store(tmp_path)
    st.build_ahead([((0,), 1), ((1,), 1), ((2, 3), 1)])  # not what gets written
    rng = np.random.default_rng(1)
    outs = _write(st, (0, 1), rng)
    outs.update(_write(st, (2,), rng))
    outs.update(_write(st, (3,), rng))
    st.finish()
    assert _ahead_files(st) == []
    _check(st, outs)


def test_discard_removes_the_index_of_a_job_that_stops(tmp_path):
    st = _store(tmp_path)
    st.build_ahead([((0, 1, 2, 3), 1)])
    assert len(_ahead_files(st)) == 1
    st.discard()
    st.discard()  # twice: nothing more
    assert _ahead_files(st) == [] and not os.path.exists(st.path)


# -- the output check of a batch --------------------------------------------------------
def _items(outs, lses):
    return [(i, np.arange(len(o)), o, ls) for i, (o, ls) in enumerate(zip(outs, lses))]


def test_check_batch_names_the_member_with_a_bad_value():
    from ringmpi.job.plan import InputError
    from ringmpi.job.resources import check_batch

    rng = np.random.default_rng(3)
    seqs = [SimpleNamespace(name=f"s{i}") for i in range(3)]
    outs = [rng.standard_normal((5, 2, 4)).astype("f4") for _ in range(3)]
    lses = [rng.standard_normal((2, 5)).astype("f4") for _ in range(3)]
    lses[0][1, 2] = -np.inf  # a row that sees no key: allowed
    out, lse = np.concatenate(outs), np.concatenate(lses, axis=1)
    check_batch("in.h5", seqs, _items(outs, lses), out, lse)
    big = [np.full((5, 2, 4), 3e38, "f4") for _ in range(3)]  # finite, the sum overflows f32
    check_batch("in.h5", seqs, _items(big, lses), np.concatenate(big), lse)
    for bad in (np.nan, np.inf, -np.inf):
        o2 = [x.copy() for x in outs]
        o2[1][3, 1, 2] = bad
        with pytest.raises(InputError, match="sequence s1: attention output is not finite"):
            check_batch("in.h5", seqs, _items(o2, lses), np.concatenate(o2), lse)
    for bad in (np.nan, np.inf):
        l2 = [x.copy() for x in lses]
        l2[2][0, 4] = bad
        with pytest.raises(InputError, match="sequence s2"):
            check_batch("in.h5", seqs, _items(outs, l2), out, np.concatenate(l2, axis=1))


def test_joined_is_concatenate_and_a_view_for_split_members():
    from ringmpi.job.resources import joined, split

    rng = np.random.default_rng(4)
    base = rng.standard_normal((1, 30, 3, 4)).astype("f4")
    out, lse = base[0], rng.standard_normal((3, 30)).astype("f4")
    parts = split(out, lse, [7, 0, 11, 12])
    o = joined([p[0] for p in parts], axis=0)
    ls = joined([p[1] for p in parts], axis=1)
    np.testing.assert_array_equal(o, out)
    np.testing.assert_array_equal(ls, lse)
    assert np.shares_memory(o, out) and np.shares_memory(ls, lse)  # no copy
    # not consecutive (reordered, a gap, separate arrays): a plain concatenation
    for pieces, axis in (
        ([out[7:18], out[:7]], 0),
        ([out[:5], out[6:9]], 0),
        ([lse[:, :4].copy(), lse[:, 4:9].copy()], 1),
    ):
        got = joined(pieces, axis)
        np.testing.assert_array_equal(got, np.concatenate(pieces, axis=axis))
