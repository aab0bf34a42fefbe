"""ringmpi.job.output.layout: part files written from the arrays (HDF5 lays out the metadata)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.job.output import layout as partfile
from ringmpi.job.output.layout import crc32_of

ROOT = str(Path(__file__).resolve().parents[3])


def _arrays(n: int, dtype, h: int = 3, d: int = 5, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = (4.0 + 0.01 * rng.standard_normal((n, h, d))).astype(dtype)  # a mean, a small spread
    if n:
        out[n // 2, 0, 0] = 6.0e4 if dtype == np.float16 else 3.0e38  # one huge value
    lse = (-2.0 + rng.standard_normal((h, n))).astype(dtype)
    return {"out": out, "lse": lse, "pos": np.arange(7, 7 + n, dtype=np.int64)}


ATTRS = {
    "sequence": "seq00001",
    "rank": 2,
    "nranks": 3,
    "layout": "zigzag",
    "sequences": ["seq00001", "seq00002"],
    "rows": np.array([0, 4, 9]),
}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 9, 70_000])
def test_the_file_reads_back_as_the_arrays_with_its_size_and_crc(tmp_path, dtype, n):
    arrays = _arrays(n, dtype)
    path = str(tmp_path / "p.h5")
    size, crc = partfile.write_arrays(path, arrays, ATTRS, sync=False)
    assert (size, crc) == crc32_of(path) and size == os.path.getsize(path)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["lse", "out", "pos"]
        for name, a in arrays.items():
            ds = f[name]
            assert ds.dtype == a.dtype and ds.shape == a.shape and ds.chunks is None
            np.testing.assert_array_equal(ds[...], a)
        assert f.attrs["sequence"] == "seq00001" and int(f.attrs["rank"]) == 2
        assert list(f.attrs["sequences"]) == ["seq00001", "seq00002"]
        np.testing.assert_array_equal(f.attrs["rows"], [0, 4, 9])
    assert os.listdir(tmp_path) == ["p.h5"]  # the temporary was renamed


def test_same_datasets_and_attributes_as_the_in_memory_image(tmp_path):
    """The general path (HDF5 writes the data, kept for compressed parts) and this one hold
    the same values; this one's file is no larger."""
    arrays = _arrays(1000, np.float32)

    def fill(f):
        for name, a in arrays.items():
            f.create_dataset(name, data=a)
        for k, v in ATTRS.items():
            f.attrs[k] = v

    a_path, b_path = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    size_a, _ = partfile.write_arrays(a_path, arrays, ATTRS)
    size_b, _ = partfile.write_h5(b_path, fill)
    assert size_a <= size_b + 4096
    with h5py.File(a_path, "r") as fa, h5py.File(b_path, "r") as fb:
        for name in arrays:
            np.testing.assert_array_equal(fa[name][...], fb[name][...])
        assert sorted(fa.attrs) == sorted(fb.attrs)


def test_the_trust_checks_accept_a_part(tmp_path):
    """Storage allocated at creation and never filled: still a dataset written in full."""
    from ringmpi.job.input import files as trust

    path = str(tmp_path / "p.h5")
    partfile.write_arrays(path, _arrays(50, np.float32), ATTRS)
    with h5py.File(path, "r") as f:
        for name in ("out", "lse", "pos"):
            assert trust.check_layout(f[name]) == "" and trust.check_written(f[name]) == ""


def test_metadata_reads_back_what_was_written_and_a_later_write_wins():
    m = partfile._Metadata()
    m.seek(10)
    m.write(b"abcdef")
    m.seek(12)
    m.write(b"XY")
    m.seek(100)
    m.write(b"z")
    buf = bytearray(8)
    m.seek(9)
    assert m.readinto(buf) == 8 and bytes(buf) == b"\0abXYef\0"
    assert m.blocks() == [(10, b"abXYef"), (100, b"z")] and m.eof == 101
    m.truncate(200)
    pieces = partfile._layout(m.blocks(), [(20, b"DATA")], m.eof)
    whole = b"".join(bytes(p) for p in pieces)
    assert len(whole) == 200 and whole[10:16] == b"abXYef" and whole[20:24] == b"DATA"
    assert whole[100:101] == b"z" and whole[:10] == bytes(10)
    with pytest.raises(RuntimeError, match="overlaps"):
        partfile._layout(m.blocks(), [(12, b"DATA")], m.eof)


def test_a_full_disk_is_a_plain_oserror_and_leaves_no_file(tmp_path):
    """The file size limit (RLIMIT_FSIZE) stands in for a full disk: the write of the data
    fails half-way; nothing is left under the final name or a temporary one."""
    code = textwrap.dedent(f"""
        import errno, os, resource, signal, sys
        import numpy as np
        sys.path.insert(0, {ROOT!r})
        from ringmpi.job.output import layout as partfile
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        a = {{"out": np.ones((100_000, 4, 4), np.float32), "pos": np.arange(100_000)}}
        try:
            partfile.write_arrays({str(tmp_path / "p.h5")!r}, a, {{"rank": 0}})
        except OSError as e:
            print("OSError", errno.errorcode.get(e.errno))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "OSError EFBIG", p.stdout + p.stderr
    assert os.listdir(tmp_path) == []
