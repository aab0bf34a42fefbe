"""Direct I/O (ringmpi.runtime.direct_io) and the reader's raw reads (ringmpi.job.input.reader).

The bytes read or written must be exactly the file's / the pieces', whatever the
alignment of offsets, lengths and buffers, across transfer boundaries (CHUNK made
small), merged into spans or not, by O_DIRECT or plain reads, and when the file
system refuses O_DIRECT (simulated: this kernel's ext4 and tmpfs both take it).
The reader must give exactly what HDF5 gives for every layout, packing, shard
split, byte order and storage it meets.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import zlib

import h5py
import numpy as np
import pytest

from ringmpi.job.input import reader as reader_mod
from ringmpi.job.input import scan as schema
from ringmpi.job.plan import InputError
from ringmpi.runtime import direct_io, files


@pytest.fixture
def small_chunks(monkeypatch):
    """Transfers of two blocks, so that every range crosses several of them."""
    monkeypatch.setattr(direct_io, "CHUNK", 2 * direct_io.ALIGN)
    monkeypatch.setattr(direct_io, "_pool", [])
    monkeypatch.setattr(direct_io, "MIN_BYTES", 0)


def _blob(path, n: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    with open(path, "wb") as fh:
        fh.write(data)
    return data


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("gap", [0, 1 << 20])
def test_gather_reads_exact_bytes_of_any_range(tmp_path, small_chunks, direct, gap):
    a = direct_io.ALIGN
    size = 7 * a + 123
    data = _blob(tmp_path / "f", size)
    rng = np.random.default_rng(1)
    cases = [
        (0, size),
        (1, 1),
        (a - 1, 2),
        (a, a),
        (3, 5 * a + 17),
        (size - 1, 1),
        (size - 300, 300),
    ]
    cases += [(int(o), int(rng.integers(1, size - o + 1))) for o in rng.integers(0, size, 40)]
    fd = (
        direct_io.open_read(str(tmp_path / "f")) if direct else os.open(tmp_path / "f", os.O_RDONLY)
    )
    assert fd is not None
    try:
        # one at a time, then all together (overlapping, unsorted) into unaligned buffers
        for off, n in cases:
            raw = np.zeros(n + 3, np.uint8)
            direct_io.gather(fd, [(off, raw[3:])], direct, gap=gap)
            assert raw[3:].tobytes() == data[off : off + n]
        outs = [np.zeros(n, np.uint8) for _, n in cases]
        calls = []
        direct_io.gather(
            fd,
            [(o, b) for (o, _), b in zip(cases, outs)],
            direct,
            gap=gap,
            progress=lambda: calls.append(1),
        )
        for (off, n), b in zip(cases, outs):
            assert b.tobytes() == data[off : off + n]
        assert calls
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_gather_scatters_rows_into_strided_arrays(tmp_path, small_chunks, direct):
    """Rows of 3 x 7 float32 (84 bytes: they straddle every transfer boundary) land in
    head-major buffers' token-major views, the same values as the file's."""
    rng = np.random.default_rng(2)
    n = 1000
    x = (0.5 + 0.1 * rng.standard_normal((n, 3, 7))).astype(np.float32)
    head = b"0123456789abc"  # the rows start off any alignment
    (tmp_path / "f").write_bytes(head + x.tobytes())
    fd = (
        direct_io.open_read(str(tmp_path / "f")) if direct else os.open(tmp_path / "f", os.O_RDONLY)
    )
    try:
        cases = [(0, n), (5, 17), (40, 499), (n - 1, n), (123, n)]  # rows [a, b)
        bufs = [np.full((3, b - a, 7), np.nan, np.float32) for a, b in cases]
        views = [buf.transpose(1, 0, 2) for buf in bufs]
        ranges = [(len(head) + a * x[0].nbytes, view) for (a, _), view in zip(cases, views)]
        direct_io.gather(fd, ranges, direct)
        for (a, b), view in zip(cases, views):
            np.testing.assert_array_equal(view, x[a:b])
    finally:
        os.close(fd)


def test_rows_larger_than_the_bounce_buffer_are_refused(tmp_path, small_chunks):
    a = direct_io.ALIGN
    (tmp_path / "f").write_bytes(bytes(8 * a))
    fd = direct_io.open_read(str(tmp_path / "f"))
    try:
        ok = np.empty((a, 3), np.uint8).T  # 3 rows of ALIGN bytes, strided
        assert not ok.flags.c_contiguous
        direct_io.gather(fd, [(7, ok)], True)
        big = np.empty((2, a + 1), np.uint8)  # rows of ALIGN + 1 bytes: more than CHUNK - ALIGN
        with pytest.raises(direct_io.DirectUnsupported):
            direct_io.gather(fd, [(0, big)], True)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_gather_past_the_end_is_an_error(tmp_path, small_chunks, direct):
    size = 3 * direct_io.ALIGN + 5
    _blob(tmp_path / "f", size)
    fd = (
        direct_io.open_read(str(tmp_path / "f")) if direct else os.open(tmp_path / "f", os.O_RDONLY)
    )
    try:
        for off, n in ((size - 4, 5), (size, 1), (0, size + 1), (size + 10 * direct_io.ALIGN, 3)):
            with pytest.raises(OSError) as e:
                direct_io.gather(
                    fd, [(0, np.zeros(4, np.uint8)), (off, np.zeros(n, np.uint8))], direct
                )
            assert e.value.errno == errno.EIO and "file ends" in str(e.value)
    finally:
        os.close(fd)


def test_refused_direct_reads_say_so(tmp_path, monkeypatch):
    _blob(tmp_path / "f", 3 * direct_io.ALIGN)
    fd = direct_io.open_read(str(tmp_path / "f"))

    def refuse(*a):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io.os, "preadv", refuse)
    try:
        with pytest.raises(direct_io.DirectUnsupported):
            direct_io.gather(fd, [(5, np.zeros(10, np.uint8))], True)
    finally:
        os.close(fd)


def test_open_read_wants_the_same_file(tmp_path, monkeypatch):
    _blob(tmp_path / "a", 10)
    _blob(tmp_path / "b", 10)
    other = os.open(tmp_path / "b", os.O_RDONLY)
    same = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        assert direct_io.open_read(str(tmp_path / "a"), other) is None
        fd = direct_io.open_read(str(tmp_path / "a"), same)
        assert fd is not None
        os.close(fd)
        os.symlink(tmp_path / "a", tmp_path / "link")
        assert direct_io.open_read(str(tmp_path / "link")) is None  # not followed
        monkeypatch.setenv("RINGMPI_DIRECT_IO", "0")
        assert not direct_io.enabled() and direct_io.open_read(str(tmp_path / "a")) is None
    finally:
        os.close(other)
        os.close(same)


def _pieces(seed: int) -> list:
    rng = np.random.default_rng(seed)
    a = direct_io.ALIGN
    out = [b"HDF5 head", bytes(a - 9), rng.standard_normal(3 * a // 8 + 5).astype(np.float64)]
    out.append(memoryview(rng.standard_normal((7, 3), dtype=np.float32)).cast("B"))
    out += [b"", bytes(rng.integers(0, 256, 2 * a + 1, dtype=np.uint8))]
    return out


def _joined(pieces) -> bytes:
    return b"".join(memoryview(p).cast("B").tobytes() for p in pieces)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_write_pieces_writes_exactly_the_pieces(tmp_path, small_chunks, seed):
    pieces = _pieces(seed)[: 3 + seed * 2]
    want = _joined(pieces)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert direct_io.set_direct(fd)
        size, crc = direct_io.write_pieces(fd, pieces)
    finally:
        os.close(fd)
    assert size == len(want) and crc == zlib.crc32(want)
    assert (tmp_path / "out").read_bytes() == want  # truncated to the size: no padding left


@pytest.mark.parametrize("how", ["direct", "off", "fcntl refused", "write refused"])
def test_replace_with_gives_the_same_file_every_way(tmp_path, small_chunks, monkeypatch, how):
    pieces = _pieces(3)
    want = _joined(pieces)
    if how == "off":
        monkeypatch.setenv("RINGMPI_DIRECT_IO", "0")
    elif how == "fcntl refused":
        monkeypatch.setattr(direct_io, "set_direct", lambda fd, on=True: not on)
    elif how == "write refused":

        def refuse(*a):
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(direct_io.os, "pwritev", refuse)
    wrote = []
    real = direct_io.write_pieces
    monkeypatch.setattr(direct_io, "write_pieces", lambda fd, p: wrote.append(1) or real(fd, p))
    path = tmp_path / "part.h5"
    path.write_bytes(b"old")
    crc = files.replace_with(str(path), pieces, sync=False, direct=True)
    assert path.read_bytes() == want and crc == zlib.crc32(want)
    assert bool(wrote) == (how in ("direct", "write refused"))
    assert [p.name for p in tmp_path.iterdir()] == ["part.h5"]  # no temporary left
    # the flags were put back for the buffered rewrite: the file still reads normally
    assert files.replace_with(str(path), b"x" * 10) == zlib.crc32(b"x" * 10)


# -- the reader: raw reads equal HDF5's ---------------------------------------------------


def _values(rng, shape, dtype):
    """Activation-like: a mean, a small spread, a few huge entries."""
    x = 0.7 + 0.05 * rng.standard_normal(shape)
    x.reshape(-1)[:: max(1, x.size // 3)] = 3e4
    return x.astype(dtype)


def _write(path, lengths, dtype="<f4", chunks=None, packed=False, shards=1):
    """Groups of q (S, 4, 8), k, v (S, 2, 8), split over ``shards`` files."""
    rng = np.random.default_rng(len(lengths))
    paths = [f"{path}.{j}.h5" for j in range(shards)]
    fs = [h5py.File(p, "w") for p in paths]
    try:
        for i, n in enumerate(lengths):
            cuts = np.linspace(0, n, shards + 1).astype(int)
            data = {nm: _values(rng, (n, h, 8), dtype) for nm, h in (("q", 4), ("k", 2), ("v", 2))}
            for j, f in enumerate(fs):
                g = f.create_group(f"s{i:03d}")
                for nm, x in data.items():
                    g.create_dataset(nm, data=x[cuts[j] : cuts[j + 1]], chunks=chunks)
                if packed and j == 0:
                    g["cu_seqlens"] = np.array([0, n // 3, n // 3 + 1, n], np.int64)
    finally:
        for f in fs:
            f.close()
    return paths


def _hdf5_only(plan):
    plan.sequences = [dataclasses.replace(s, storage=None) for s in plan.sequences]
    return plan


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize(
    "kind", ["plain", "packed", "shards", "big-endian", "chunked", "float64", "float16"]
)
@pytest.mark.parametrize(
    "layout, size", [("zigzag", 1), ("zigzag", 3), ("contiguous", 2), ("striped", 2)]
)
def test_raw_reads_equal_hdf5_reads(
    tmp_path, monkeypatch, small_chunks, direct, kind, layout, size
):
    monkeypatch.setenv("RINGMPI_DIRECT_IO", direct)
    dtype = {"big-endian": ">f4", "float64": "<f8", "float16": "<f2"}.get(kind, "<f4")
    paths = _write(
        tmp_path / "in",
        [97, 300, 64, 1000],
        dtype=dtype,
        chunks=(16, 2, 8) if kind == "chunked" else None,
        packed=kind == "packed",
        shards=2 if kind == "shards" else 1,
    )
    plan = schema.scan(paths)
    raw_known = kind not in ("big-endian", "chunked")
    for s in plan.sequences:
        assert all((o is not None) == raw_known for at in s.storage for o in at.values())
    ref = _hdf5_only(schema.scan(paths))
    for rank in range(size):
        a = reader_mod.Reader(plan, rank, size, layout)
        b = reader_mod.Reader(ref, rank, size, layout)
        try:
            got = a.read_many(plan.sequences)  # one batch: every raw range gathered at once
            for seq_ref, qkv in zip(ref.sequences, got):
                for x, y in zip(qkv, b.read(seq_ref)):
                    assert x.dtype == np.dtype(dtype).newbyteorder("=")
                    np.testing.assert_array_equal(x, y)
            assert a.bytes_read == b.bytes_read
            used = any(fd is not None for fd in a.raw.direct.values())  # went O_DIRECT
            # (striped: each rank's rows are strided, HDF5 reads them)
            assert used == (direct == "1" and raw_known and (layout != "striped" or size == 1))
        finally:
            a.close()
            b.close()


def test_a_file_cut_after_the_scan_is_a_clear_error(tmp_path, monkeypatch, small_chunks):
    (path,) = _write(tmp_path / "in", [500, 700])
    plan = schema.scan([path])
    rd = reader_mod.Reader(plan, 0, 1, "zigzag")
    try:
        rd.read(plan.sequences[0])  # the file is open (HDF5 itself refuses to open it cut)
        os.truncate(path, os.path.getsize(path) - 3000)  # the last dataset's tail is gone
        with pytest.raises(InputError, match="cannot read its data.*file ends"):
            rd.read(plan.sequences[-1])
    finally:
        rd.close()
