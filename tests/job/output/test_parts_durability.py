"""When the part files and markers are fsync'ed (RINGMPI_FSYNC_S), and the job's malloc switch."""

import ctypes
import os

import h5py
import numpy as np
import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.job import resources as heap
from ringmpi.job.input.scan import scan
from ringmpi.job.output import parts as store
from ringmpi.job.output.parts import OutputStore, fingerprint
from ringmpi.job.plan import InputError

S, H, HKV, D = 16, 2, 1, 8


def _store(tmp_path, n=3):
    paths = make_data(
        str(tmp_path / "in.h5"), seq_len=S, heads=H, kv_heads=HKV, head_dim=D, sequences=n
    )
    plan = scan(paths)
    meta = fingerprint(plan, "zigzag", True, None, 1)
    st = OutputStore(str(tmp_path / "out.h5"), None, plan, meta)
    st.open(False)
    return st


def _write(st, i, rng):
    o = rng.standard_normal((S, H, D)).astype("f4")
    lse = rng.standard_normal((H, S)).astype("f4")
    st.write(i, np.arange(S), o, lse)
    return o, lse


@pytest.fixture
def synced(monkeypatch):
    """Record every fsync_path the store makes."""
    calls = []
    real = store.fsync_path

    def record(path):
        calls.append(os.path.basename(path))
        real(path)

    monkeypatch.setattr(store, "fsync_path", record)
    return calls


def test_batches_are_synced_together_and_before_the_output(tmp_path, monkeypatch, synced):
    monkeypatch.setenv("RINGMPI_FSYNC_S", "3600")
    st = _store(tmp_path)
    rng = np.random.default_rng(0)
    outs = [_write(st, i, rng) for i in range(3)]
    assert synced == [] and len(st.unsynced) == 6  # 3 parts + 3 markers, none synced yet
    st.finish()
    # every part and marker, then the folder, before the output was written
    assert sorted(synced[:6]) == sorted(
        [
            "s000000.r00000.h5",
            "s000001.r00000.h5",
            "s000002.r00000.h5",
            "s000000.done",
            "s000001.done",
            "s000002.done",
        ]
    )
    assert synced[6] == "out.h5.parts" and st.unsynced == []
    with h5py.File(st.path, "r") as f:
        for i, (o, lse) in enumerate(outs):
            np.testing.assert_array_equal(f[f"seq00{i}"]["out"][...], o)
            np.testing.assert_array_equal(f[f"seq00{i}"]["lse"][...], lse)


def test_fsync_every_batch_with_zero(tmp_path, monkeypatch, synced):
    monkeypatch.setenv("RINGMPI_FSYNC_S", "0")
    st = _store(tmp_path, n=2)
    rng = np.random.default_rng(1)
    _write(st, 0, rng)
    # the part (synced as it is written), then the marker: nothing left for later
    assert synced == ["s000000.r00000.h5", "out.h5.parts", "s000000.done", "out.h5.parts"]
    assert st.unsynced == []


def test_due_sync_after_the_interval(tmp_path, monkeypatch, synced):
    monkeypatch.setenv("RINGMPI_FSYNC_S", "30")
    st = _store(tmp_path, n=2)
    rng = np.random.default_rng(2)
    _write(st, 0, rng)
    assert synced == []
    st.synced_at -= 31  # 31 s later: the next write syncs what is pending
    _write(st, 1, rng)
    assert "s000000.done" in synced and "s000000.r00000.h5" in synced


def test_bad_fsync_interval_is_an_input_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGMPI_FSYNC_S", "-1")
    with pytest.raises(InputError, match="RINGMPI_FSYNC_S"):
        _store(tmp_path)


def _mallopt_calls(monkeypatch):
    """Replace glibc's mallopt/malloc_trim by recorders (the real ones stay untouched)."""
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(heap, "_glibc", lambda: FakeLibc())
    return calls


def test_keep_freed_sets_and_restores_malloc(monkeypatch):
    calls = _mallopt_calls(monkeypatch)
    monkeypatch.delenv("RINGMPI_KEEP_MEMORY", raising=False)
    keep = heap.keep_freed()
    assert keep.active
    assert calls == [(heap._M_TRIM_THRESHOLD, 2**31 - 1), (heap._M_MMAP_MAX, 0)]
    keep.restore()
    assert not keep.active
    assert calls[2:] == [
        (heap._M_MMAP_MAX, 65536),
        (heap._M_TRIM_THRESHOLD, 128 * 1024),
        ("trim", 0),
    ]
    keep.restore()  # twice: nothing more
    assert len(calls) == 5


def test_keep_memory_off(monkeypatch):
    calls = _mallopt_calls(monkeypatch)
    monkeypatch.setenv("RINGMPI_KEEP_MEMORY", "0")
    keep = heap.keep_freed()
    assert not keep.active and calls == []


def test_keep_freed_on_this_libc():
    """On glibc the real switches are accepted (mallopt returns 1) and undone."""
    libc = heap._glibc()
    if libc is None:
        pytest.skip("not glibc: keep_freed changes nothing here")
    keep = heap.keep_freed()
    try:
        assert keep.active
        a = np.ones(64 << 20, np.uint8)  # a block that would otherwise be mmap'ed
        assert int(a.sum()) == 64 << 20
        del a
    finally:
        keep.restore()
    assert isinstance(libc, ctypes.CDLL)
