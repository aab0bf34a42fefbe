"""The smaller items of issue 26 (item 7): head-major input, shard/gather axes, .tmp files,
the ringmpi.testing example. (The verify operator and the one-process start line are in
job/test_verify.py and job/test_resources_threads.py.)"""

from __future__ import annotations

import errno
import glob
import os
import re

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
import ringmpi.testing
from ringmpi.cli import make_data as sample_mod
from ringmpi.cli.main import main
from ringmpi.cli.make_data import make_data
from ringmpi.job.output import parts as store_mod
from ringmpi.job.plan import InputError
from ringmpi.job.run import run


def test_head_major_input_stops_with_the_advice(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "hm.h5"
    with h5py.File(path, "w") as f:  # (H, S, D) where (S, H, D) belongs
        f["q"] = (0.5 + 0.1 * rng.standard_normal((12, 4096, 8))).astype("f4")
        f["k"] = f["v"] = (0.5 + 0.1 * rng.standard_normal((12, 4096, 8))).astype("f4")
    out = tmp_path / "o.h5"
    assert main(["run", str(path), "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "S=12 tokens but H=4096 heads" in err and "np.swapaxes" in err and "GiB" not in err
    assert not out.exists() and not os.path.exists(str(out) + ".parts")


def test_shard_warns_on_a_head_major_array():
    comm = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank())  # a ring of one
    x = np.zeros((4, 64, 8))
    with pytest.warns(UserWarning, match=r"4 tokens but 64 heads.*swapaxes"):
        ringmpi.shard(x, comm)
    comm.Free()


def test_shard_and_gather_refuse_a_missing_token_axis_with_one_value_error():
    comm = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank())
    x = np.arange(20.0).reshape(10, 2)
    with pytest.raises(ValueError, match=r"shard: the token axis -3 does not exist.*\(10, 2\)"):
        ringmpi.shard(x, comm)
    with pytest.raises(ValueError, match=r"gather: the token axis -3 does not exist.*\(10, 2\)"):
        ringmpi.gather(x, 10, comm)
    with pytest.raises(ValueError, match="token axis 5 does not exist"):
        ringmpi.shard(x, comm, axis=5)
    assert np.array_equal(ringmpi.gather(ringmpi.shard(x, comm, axis=0), 10, comm, axis=0), x)
    comm.Free()


def test_no_tmp_part_file_left_on_a_full_disk(tmp_path, monkeypatch):
    (x,) = make_data(str(tmp_path / "in.h5"), seq_len=64, heads=2, kv_heads=1, head_dim=8)

    def full_disk(path, arrays, attrs, sync=True):
        with open(path, "wb") as fh:
            fh.write(b"\0" * 100)  # part of the file made it to disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "write_arrays", full_disk)
    out = str(tmp_path / "out.h5")
    with pytest.raises(InputError, match="No space left on device"):
        run([x], out, quiet=True, output_mode="parts")
    assert glob.glob(out + ".parts/*.tmp") == [] and not os.path.exists(out)


def test_make_data_leaves_no_tmp_file_when_writing_fails(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sample_mod, "_write_family", fail)
    with pytest.raises(OSError):
        make_data(str(tmp_path / "in.h5"), seq_len=64)
    assert os.listdir(tmp_path) == []


def test_testing_docstring_example_runs():
    """The example in ringmpi.testing's docstring, executed as written (on one rank)."""
    doc = ringmpi.testing.__doc__
    block = doc[doc.index("::\n") + 3 : doc.index("\nThe rule:")]
    code = "\n".join(ln[4:] for ln in block.splitlines())
    assert "(ref, _), (peer, _) = reference_pair" in code
    names: dict = {}
    exec(compile(code, "ringmpi.testing example", "exec"), names)  # noqa: S102 - our own docs
    names["test_my_layer"]()
    assert ringmpi.testing.PYTEST_PLUGIN == "ringmpi.pytest_plugin"
    assert re.search(r"-p ringmpi\.pytest_plugin", doc.replace("\n", " "))
