"""The batch job on several rings (--ring-size): matches the reference and the one-ring job."""

import glob

import h5py
import numpy as np
import pytest
from cli.test_main_mpi import _digests, _read_inputs, check_against_reference, launch

from ringmpi.cli.make_data import make_data

H, HKV, D = 4, 2, 16


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    d = tmp_path_factory.mktemp("rings")
    return make_data(
        str(d / "in.h5"), seq_len=301, sequences=5, heads=H, kv_heads=HKV, head_dim=D, seed=3
    )


def _outputs(path):
    with h5py.File(path, "r") as f:
        return {g: (f[g]["out"][...], f[g]["lse"][...]) for g in sorted(f) if "out" in f[g]}


def test_two_rings_of_two_match_reference_and_one_ring(five, tmp_path):
    one, two = str(tmp_path / "one.h5"), str(tmp_path / "two.h5")
    rc, _, se, _ = launch(4, "run", *five, "-o", one, "--causal", "--quiet")
    assert rc == 0, se
    rc, so, se, _ = launch(
        4,
        "run",
        *five,
        "-o",
        two,
        "--causal",
        "--ring-size",
        "2",
        "--summary-json",
        str(tmp_path / "s.json"),
    )
    assert rc == 0, se
    assert "as 2 rings of 2" in se + so
    a, b = _outputs(one), _outputs(two)
    assert sorted(a) == sorted(b) and len(a) == 5
    for g in a:
        q, k, v = _read_inputs(five, group=g)
        check_against_reference(two, q, k, v, True, group=g)
        # a ring of 2 sums in another order than a ring of 4: close, not bitwise
        assert np.abs(a[g][0] - b[g][0]).max() < 1e-5 and np.isfinite(b[g][0]).all()
    with h5py.File(two, "r") as f:
        assert int(f.attrs["ring_size"]) == 2


def test_rings_resume_after_kill_is_bitwise_identical(five, tmp_path):
    out = str(tmp_path / "out.h5")
    args = ["run", *five, "-o", out, "--causal", "--quiet", "--ring-size", "2"]
    rc, _, se, _ = launch(4, *args)
    assert rc == 0, se
    want = _digests(out)
    rc, _, _, _ = launch(4, *args, "--overwrite", env={"RINGMPI_TEST_KILL_AFTER": "1"})
    assert rc != 0
    done = len(glob.glob(out + ".parts/*.done"))
    assert 1 <= done < 5  # killed part way; rank 0's ring finished one
    rc, so, se, _ = launch(4, *args, "--resume")
    assert rc == 0, se
    assert _digests(out) == want


@pytest.mark.parametrize("bad", ["3", "0", "many"])
def test_bad_ring_size_is_one_clear_error(five, tmp_path, bad):
    out = str(tmp_path / "bad.h5")
    rc, so, se, _ = launch(4, "run", *five, "-o", out, "--ring-size", bad)
    assert rc == 2, se
    lines = [ln for ln in se.splitlines() if ln.startswith("ringmpi: error")]
    assert len(lines) == 1 and "ring-size" in lines[0], se
    assert not glob.glob(out + "*")
