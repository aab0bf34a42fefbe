"""Planning is bounded (issue 22, item 6): offsets stay out of broadcasts, interrupts act.

The plan rank 0 broadcasts carries the length and SHA-256 of each packed-sequence
offsets array, not the array: every rank reads it itself, in bounded slabs, and
refuses one that differs from what rank 0 checked. A Ctrl-C while a file of many
groups is scanned stops the scan at the next group, not at its end.
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.job.input import files as inputs
from ringmpi.job.input import scan as offsets
from ringmpi.job.input import scan as schema
from ringmpi.runtime import interrupt
from ringmpi.testing import assert_all

S, H, HKV, D = 4096, 2, 1, 8
PACKED = 1500  # packed sequences per group


def _values(rng, shape):
    return (0.4 + 0.03 * rng.standard_normal(shape)).astype(np.float32)


def _cu(rng, n_tokens: int, n_seqs: int) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), n_seqs - 1, replace=False))
    return np.concatenate(([0], cuts, [n_tokens])).astype(np.int64)


def _packed(path: Path, groups: int = 2, seed: int = 0) -> dict:
    """An input of ``groups`` groups, each S tokens in PACKED packed sequences; {group: cu}."""
    rng = np.random.default_rng(seed)
    cus = {}
    with h5py.File(path, "w") as f:
        for j in range(groups):
            g = f.create_group(f"g{j}")
            g["q"] = _values(rng, (S, H, D))
            g["k"] = _values(rng, (S, HKV, D))
            g["v"] = _values(rng, (S, HKV, D))
            cus[f"g{j}"] = g["cu_seqlens"] = _cu(rng, S, PACKED)
    return cus


def test_offsets_stay_out_of_the_broadcast_and_are_checked(tmp_path):
    p = tmp_path / "packed.h5"
    cus = _packed(p)
    plan = schema.scan([str(p)])
    stripped, sums = offsets.strip(plan)
    assert all(s.cu_seqlens is None for s in stripped.sequences)
    assert all(s.cu_seqlens is not None for s in plan.sequences)  # the original is kept
    small, big = len(pickle.dumps((stripped, sums))), len(pickle.dumps(plan))
    assert small < 4096 and big > 2 * PACKED * 8, (small, big)
    filled = offsets.fill(stripped, sums)
    for s in filled.sequences:
        np.testing.assert_array_equal(s.cu_seqlens, cus[s.group])
    # the file changes after rank 0 checked it: another valid split of the same tokens
    with h5py.File(p, "r+") as f:
        f["g1/cu_seqlens"][...] = _cu(np.random.default_rng(7), S, PACKED)
    with pytest.raises(schema.InputError, match="differs from what rank 0 checked"):
        offsets.fill(stripped, sums)
    with h5py.File(p, "r+") as f:
        del f["g1/cu_seqlens"]
        f["g1/cu_seqlens"] = np.arange(0, S + 1, 2, dtype=np.int64)  # longer than rank 0's
    with pytest.raises(schema.InputError, match="offsets for"):
        offsets.fill(stripped, sums)


def test_interrupt_acts_while_a_file_of_many_groups_is_scanned(tmp_path, monkeypatch):
    p = tmp_path / "many.h5"
    rng = np.random.default_rng(3)
    groups = 400
    with h5py.File(p, "w") as f:
        for j in range(groups):
            g = f.create_group(f"s{j:04d}")
            for n, h in (("q", H), ("k", HKV), ("v", HKV)):
                g[n] = _values(rng, (16, h, D))
    calls = []
    real = inputs.lite_dataset

    def lite_dataset(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # Ctrl-C while the first group is looked at
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(inputs, "lite_dataset", lite_dataset)
    with pytest.raises(interrupt.Interrupted):
        with interrupt.catching((signal.SIGINT,)):
            schema.scan([str(p)])
    # the scan stopped at the second group: 3 datasets of the first, none of the rest
    assert len(calls) == 3, len(calls)


def _shared_dir(comm) -> str:
    d = tempfile.mkdtemp(prefix="ringmpi-plan-") if comm.Get_rank() == 0 else None
    return comm.bcast(d, root=0)


@pytest.mark.mpi
def test_every_rank_reads_the_offsets_rank_0_checked(comm):
    d = Path(_shared_dir(comm))
    p = d / "packed.h5"
    cus = _packed(p, groups=3, seed=comm.Get_size()) if comm.Get_rank() == 0 else None
    cus = comm.bcast(cus, root=0)
    plan = schema.make_plan(comm, [str(p)], None, comm.Get_size())
    ok = all(np.array_equal(s.cu_seqlens, cus[s.group]) for s in plan.sequences)
    assert_all(comm, ok and len(plan.sequences) == 3, "offsets differ from the file's")
    comm.Barrier()
    if comm.Get_rank() == 0:
        p.unlink()
        os.rmdir(d)


def _refused_when_the_last_rank_reads_another(comm, monkeypatch, path, reader: str, at, by):
    """The last rank's ``inputs.<reader>`` returns its array with element ``at`` moved ``by``
    (offsets or slices changed, still valid, between rank 0's check and this rank's read):
    planning must fail on every rank with the same message."""
    if comm.Get_rank() == comm.Get_size() - 1:
        real = getattr(inputs, reader)

        def changed(*args, **kwargs):
            a = real(*args, **kwargs)
            a[at] += by
            return a

        monkeypatch.setattr(inputs, reader, changed)
    try:
        schema.make_plan(comm, [str(path)], None, comm.Get_size())
        err = "no error"
    except schema.InputError as e:
        err = str(e)
    assert_all(comm, "differs from what rank 0 checked" in err, err)


@pytest.mark.mpi
def test_offsets_changed_under_planning_fail_on_every_rank(comm, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("one rank reads the offsets once: nothing to compare (see the serial test)")
    d = Path(_shared_dir(comm))
    p = d / "packed.h5"
    if comm.Get_rank() == 0:
        _packed(p, groups=2)
    comm.Barrier()
    _refused_when_the_last_rank_reads_another(comm, monkeypatch, p, "read_offsets", (1,), 1)
    comm.Barrier()
    if comm.Get_rank() == 0:
        p.unlink()
        os.rmdir(d)


def _sliced(path: Path, groups: int = 2) -> dict:
    """An input of ``groups`` groups of 300 tokens, each with a mask of slices; {group: table}."""
    rng = np.random.default_rng(5)
    tables = {}
    with h5py.File(path, "w") as f:
        for j in range(groups):
            g = f.create_group(f"g{j}")
            g["q"] = _values(rng, (300, H, D))
            g["k"] = _values(rng, (300, HKV, D))
            g["v"] = _values(rng, (300, HKV, D))
            t = np.array([[0, 300, 0, 20 + j, 0], [0, 300, 0, 300, 1], [100, 300, 50, 250, 3]])
            tables[f"g{j}"] = g["slices"] = t
    return tables


def test_slices_stay_out_of_the_broadcast_and_are_checked(tmp_path):
    """issue 41: a mask of slices travels as its digest, like the offsets."""
    from ringmpi.slices import Slices

    p = tmp_path / "sliced.h5"
    tables = _sliced(p)
    plan = schema.scan([str(p)])
    stripped, sums = offsets.strip(plan)
    assert all(s.slices is None for s in stripped.sequences)
    assert all(s.slices == Slices(tables[s.group]) for s in offsets.fill(stripped, sums).sequences)
    with h5py.File(p, "r+") as f:  # changed after rank 0 checked it, still valid
        f["g1/slices"][0, 3] = 30
    with pytest.raises(schema.InputError, match="'slices' of sequence g1 differs from what rank 0"):
        offsets.fill(stripped, sums)
    with h5py.File(p, "r+") as f:  # changed into a malformed one: the same checks as rank 0's
        f["g1/slices"][0, 4] = 4
    with pytest.raises(schema.InputError, match="kind code 4"):
        offsets.fill(stripped, sums)


@pytest.mark.mpi
def test_slices_changed_under_planning_fail_on_every_rank(comm, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("one rank reads the slices once: nothing to compare (see the serial test)")
    d = Path(_shared_dir(comm))
    p = d / "sliced.h5"
    tables = _sliced(p) if comm.Get_rank() == 0 else None
    tables = comm.bcast(tables, root=0)
    plan = schema.make_plan(comm, [str(p)], None, comm.Get_size())
    ok = all(s.slices.table().tolist() == sorted(tables[s.group].tolist()) for s in plan.sequences)
    assert_all(comm, ok, "slices differ from the file's")
    _refused_when_the_last_rank_reads_another(comm, monkeypatch, p, "read_slices", (0, 1), -1)
    comm.Barrier()
    if comm.Get_rank() == 0:
        p.unlink()
        os.rmdir(d)
