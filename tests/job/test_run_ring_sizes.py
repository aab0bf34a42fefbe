"""--ring-size auto: a ring size per sequence (rings of one for short work, more for long).

The assignment rule (ringmpi.job.run) on plans of known shape, then the job on a
dataset of one long and many short sequences (real-shaped values) at P = 2, 3, 4:
matches the dense float64 reference, says which ring sizes ran how many tokens,
and a kill in either phase resumes to the same bytes.
"""

from __future__ import annotations

import glob
import json
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import HKV, H, _digests, _read_inputs, check_against_reference, launch

from ringmpi.job.run import assign_ring_sizes, phases

D = 16  # cli/test_main_mpi.py: check_against_reference scales by its D
LENGTHS = [2400, 150, 97, 301, 64, 211, 33, 180, 128, 75]


def _plan(lengths, d=64, dtype="float32"):
    seqs = [
        SimpleNamespace(
            name=f"s{i}",
            length=n,
            length_k=n,
            cu_seqlens=None,
            cu_seqlens_k=None,
            packed=False,
            cross=False,
        )
        for i, n in enumerate(lengths)
    ]
    return SimpleNamespace(
        sequences=seqs,
        heads=4,
        kv_heads=2,
        head_dim=d,
        dtype=dtype,
        features=0,
        rope=None,
        weights=None,
        files=["x"],
        mode="qkv",
    )


BIG = 1 << 40  # a memory budget nothing exceeds


def test_many_short_sequences_take_rings_of_one():
    assert assign_ring_sizes(_plan([256] * 200), 2, "zigzag", True, BIG) == [1] * 200
    assert assign_ring_sizes(_plan([2048] * 48), 4, "zigzag", True, BIG) == [1] * 48


def test_one_sequence_takes_every_rank():
    assert assign_ring_sizes(_plan([4096]), 4, "zigzag", True, BIG) == [4]
    assert assign_ring_sizes(_plan([4096]), 3, "contiguous", False, BIG) == [3]


def test_a_long_sequence_among_short_ones_gets_a_larger_ring():
    sizes = assign_ring_sizes(_plan(LENGTHS), 2, "zigzag", True, BIG)
    assert sizes == [2] + [1] * (len(LENGTHS) - 1)
    # on 4 ranks the long one needs no more than the work rule asks (here: all 4)
    sizes4 = assign_ring_sizes(_plan(LENGTHS), 4, "zigzag", True, BIG)
    assert sizes4[0] == 4 and set(sizes4[1:]) == {1}
    assert phases(sizes4) == [(4, [0]), (1, list(range(1, len(LENGTHS))))]


def test_memory_raises_the_ring_size():
    from ringmpi.job.resources import rank_bytes, seq_counts

    plan = _plan([4096] * 8)
    one = rank_bytes(
        plan,
        *seq_counts(plan.sequences[0], 1, "zigzag")[:1],
        prefetch=True,
        n_local_k=4096,
        ranks=1,
    )
    sizes = assign_ring_sizes(plan, 4, "zigzag", True, one // 2)
    assert set(sizes) in ({2}, {4})  # rings of one would not fit


def test_ring_size_is_bounded_by_the_shortest_side():
    # 3 tokens cannot feed a ring of 4: the largest ring it can feed
    sizes = assign_ring_sizes(_plan([3, 5000]), 4, "zigzag", True, BIG)
    assert sizes[1] == 4 and sizes[0] <= 3


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One long sequence and many short ones, k and v with nonzero means and small spreads."""
    path = str(tmp_path_factory.mktemp("auto") / "mixed.h5")
    with h5py.File(path, "w") as f:
        for i, n in enumerate(LENGTHS):
            rng = np.random.default_rng([11, i])
            g = f.create_group(f"seq{i:03d}")
            g["q"] = (0.2 + rng.standard_normal((n, H, D))).astype(np.float32)
            g["k"] = (0.5 + 0.1 * rng.standard_normal((n, HKV, D))).astype(np.float32)
            g["v"] = (1.0 + 0.1 * rng.standard_normal((n, HKV, D))).astype(np.float32)
    return [path]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_auto_job_matches_reference_and_reports_sizes(mixed, tmp_path, p):
    out, sj = str(tmp_path / "out.h5"), str(tmp_path / "s.json")
    rc, so, se, _ = launch(
        p, "run", *mixed, "-o", out, "--causal", "--ring-size", "auto", "--summary-json", sj
    )
    assert rc == 0, se
    assert "(--ring-size auto)" in se + so and f"on a ring of {p}" in se + so
    s = json.load(open(sj))
    assert s["ring_size"] == "auto"
    assert s["ring_sizes"] == {str(p): LENGTHS[0], "1": sum(LENGTHS[1:])}
    assert s["tokens"] == sum(LENGTHS) and s["sequences"] == len(LENGTHS)
    with h5py.File(out, "r") as f:
        assert f.attrs["ring_size"] == "auto"
        assert list(f.attrs["ring_sizes"]) == [p] + [1] * (len(LENGTHS) - 1)
        groups = sorted(g for g in f if "out" in f[g])
    assert len(groups) == len(LENGTHS)
    for g in groups:
        q, k, v = _read_inputs(mixed, group=g)
        check_against_reference(out, q, k, v, True, group=g)
    rc, so, se, _ = launch(p, "verify", out, *mixed)
    assert rc == 0 and "PASSED" in so + se, se


@pytest.mark.parametrize("kill_after", [1, 3])  # in the ring-of-P phase / in the rings of one
def test_kill_in_either_phase_then_resume_is_bitwise(mixed, tmp_path, kill_after):
    out = str(tmp_path / "out.h5")
    args = ["run", *mixed, "-o", out, "--causal", "--quiet", "--ring-size", "auto"]
    one = {"RINGMPI_BATCH_TOKENS": "0"}  # one marker per sequence: the kill point is exact
    rc, _, se, _ = launch(2, *args, env=one)
    assert rc == 0, se
    want = _digests(out)
    rc, _, _, _ = launch(
        2, *args, "--overwrite", env=dict(one, RINGMPI_TEST_KILL_AFTER=str(kill_after))
    )
    assert rc != 0
    done = len(glob.glob(out + ".parts/*.done"))
    assert 1 <= done < len(LENGTHS)
    rc, so, se, _ = launch(2, *args, "--resume", env=one)
    assert rc == 0, se
    assert _digests(out) == want


def test_auto_and_fixed_runs_do_not_resume_each_other(mixed, tmp_path):
    out = str(tmp_path / "out.h5")
    base = ["run", *mixed, "-o", out, "--causal", "--quiet"]
    rc, _, _, _ = launch(2, *base, "--ring-size", "auto", env={"RINGMPI_TEST_KILL_AFTER": "1"})
    assert rc != 0
    rc, so, se, _ = launch(2, *base, "--ring-size", "1", "--resume")
    assert rc == 2 and "ring_size" in se, se
