"""Reads are watched (issue 22, item 7): a stuck read ends the job, and so does SIGTERM.

A read stuck in the file system is emulated by ``RINGMPI_TEST_READ_STALL_S``
(:mod:`ringmpi.job.input.reader`): the reader thread sleeps while it holds h5py's global
lock, as a read blocked inside HDF5 does. The job (``ringmpi run`` under mpiexec)
must then end with one line: after ``RINGMPI_WATCHDOG_S`` (exit 124) when nobody
stops it, within seconds of a SIGTERM (exit 143), never joined forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.job.input import reader as reader_mod
from ringmpi.runtime import faults, watchdog

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")


def _data(d: Path) -> Path:
    """Two small sequences of activation-like values (nonzero mean, small spread)."""
    rng = np.random.default_rng(1)
    p = d / "in.h5"
    with h5py.File(p, "w") as f:
        for name in ("s0", "s1"):
            g = f.create_group(name)
            for n, h in (("q", 4), ("k", 2), ("v", 2)):
                g[n] = (0.6 + 0.05 * rng.standard_normal((96, h, 16))).astype(np.float32)
    return p


def _job(tmp_path: Path, ranks: int, env: dict) -> subprocess.Popen:
    inp = _data(tmp_path)
    cmd = [
        PY,
        "-m",
        "mpi4py",
        "-m",
        "ringmpi",
        "run",
        str(inp),
        "-o",
        str(tmp_path / "out.h5"),
        "--quiet",
    ]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    full = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> tuple:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within {timeout} s: {err[-2000:]}")
    return proc.returncode, [x for x in err.splitlines() if x.strip()]


@pytest.mark.parametrize("ranks", [1, 2])
def test_stuck_read_ends_the_job_after_the_watchdog(tmp_path, ranks):
    # the stuck rank is the last one: at P=2 rank 0 waits for it in the agreement
    stall = f"{ranks - 1}:3600"
    t0 = time.monotonic()
    proc = _job(tmp_path, ranks, {faults.READ_STALL: stall, watchdog.ENV: "3"})
    rc, lines = _finish(proc, 60)
    took = time.monotonic() - t0
    assert rc == watchdog.EXIT_STATUS, (rc, lines)
    mine = [x for x in lines if "its own read of sequence" in x]
    assert len(mine) == 1 and "the file system is stuck" in mine[0], lines
    assert f"rank {ranks - 1}" in mine[0] or ranks == 1, mine
    assert all(x.startswith("ringmpi: watchdog:") for x in lines), lines
    assert 3 < took < 40, took
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_during_a_stuck_read_ends_the_job_promptly(tmp_path, ranks):
    # watchdog far away: only the SIGTERM can end it
    proc = _job(tmp_path, ranks, {faults.READ_STALL: "3600", watchdog.ENV: "600"})
    time.sleep(6 if ranks > 1 else 4)  # past the start: the first read is stuck by now
    assert proc.poll() is None, proc.communicate()
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    rc, lines = _finish(proc, 30)
    took = time.monotonic() - t0
    from mpi4py import MPI

    if ranks > 1 and "Open MPI" in MPI.Get_library_version():
        # Open MPI's mpiexec answers the SIGTERM itself: exit 1, the ranks' last lines dropped
        assert rc != 0, (rc, lines)
    else:
        assert rc == 128 + signal.SIGTERM, (rc, lines)
        assert len(lines) == 1 and "interrupted (SIGTERM" in lines[0], lines
        assert "while reading" in lines[0], lines
    assert took < 8, took
    assert not (tmp_path / "out.h5").exists()


def test_watch_moves_its_deadline_on_progress(monkeypatch):
    """A wait that keeps making progress outlives the limit; the deadline never moves back."""
    monkeypatch.setenv(watchdog.ENV, "0.6")
    fired = []

    def fire(self):  # called with the lock held: record, and stand down instead of exiting
        fired.append(self.what)
        self.deadline = None

    monkeypatch.setattr(watchdog._Dog, "_fire", fire)
    with watchdog.watch("a moving read", why="test") as moved:
        for _ in range(8):  # 1.6 s in all, never 0.6 s without progress
            time.sleep(0.2)
            moved(time.monotonic())
        moved(time.monotonic() - 100)  # older progress does not shorten it
        time.sleep(0.2)
    assert fired == []
    with watchdog.watch("a stuck read", why="test"):
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    assert fired == ["a stuck read"]


def test_reads_run_in_daemon_threads():
    """The background read is a daemon thread: the interpreter never joins it at exit."""
    started, release = threading.Event(), threading.Event()
    seen = []

    def work(x):
        seen.append(threading.current_thread().daemon)
        started.set()
        release.wait(5)
        return x * 2

    fut = reader_mod.in_background(work, 21)
    assert started.wait(5)
    assert seen == [True]
    release.set()
    assert fut.result(5) == 42
    boom = reader_mod.in_background(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(5)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_contiguous_reads_go_in_bounded_slabs(tmp_path, monkeypatch, layout):
    """No single HDF5 read is larger than SLAB_BYTES, so a moving read keeps the watchdog fed;
    the rows read are the file's, exactly. (HDF5 reads them when the plan does not say
    where their bytes lie; the raw reads are bounded by the next test.)"""
    import dataclasses

    from ringmpi.job.input import scan as schema

    p = _data(tmp_path)
    monkeypatch.setattr(reader_mod, "SLAB_BYTES", 1000)  # q rows are 4*16*4 = 256 bytes
    calls = []
    real = h5py.Dataset.read_direct

    def counted(self, dest, source_sel=None, dest_sel=None):
        calls.append(dest.nbytes)
        return real(self, dest, source_sel, dest_sel)

    monkeypatch.setattr(h5py.Dataset, "read_direct", counted)
    plan = schema.scan([str(p)])
    with h5py.File(p, "r", locking=False) as f:
        for rank in range(2):
            rd = reader_mod.Reader(plan, rank, 2, layout)
            seq = dataclasses.replace(plan.sequences[1], storage=None)
            q, k, v = rd.read(seq)
            pos, pos_k = rd.positions(seq), rd.positions_k(seq)
            np.testing.assert_array_equal(q, f["s1/q"][...][pos])
            np.testing.assert_array_equal(k, f["s1/k"][...][pos_k])
            np.testing.assert_array_equal(v, f["s1/v"][...][pos_k])
            assert rd.bytes_read == q.nbytes + k.nbytes + v.nbytes
            rd.close()
    assert calls and max(calls) <= 1000, calls
    assert len(calls) >= 2 * (48 * 256 // 1000), len(calls)  # 48 q rows per rank: 13+ slabs


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_raw_reads_go_in_bounded_transfers(tmp_path, monkeypatch, layout, direct):
    """Rows whose bytes' place the plan knows are read without HDF5, by O_DIRECT or plain
    reads, in transfers of at most direct_io.CHUNK bytes (the watchdog sees progress after
    each); the rows are the file's, exactly, and HDF5 reads none of them."""
    from ringmpi.job.input import scan as schema
    from ringmpi.runtime import direct_io

    p = _data(tmp_path)
    monkeypatch.setenv("RINGMPI_DIRECT_IO", direct)
    monkeypatch.setattr(direct_io, "CHUNK", 2 * direct_io.ALIGN)
    monkeypatch.setattr(direct_io, "MIN_BYTES", 0)
    monkeypatch.setattr(direct_io, "_pool", [])
    sizes, moved = [], []
    real = os.preadv

    def counted(fd, buffers, offset):
        sizes.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "preadv", counted)
    monkeypatch.setattr(h5py.Dataset, "read_direct", lambda *a, **k: pytest.fail("HDF5 read"))
    plan = schema.scan([str(p)])
    assert plan.sequences[1].storage is not None
    with h5py.File(p, "r", locking=False) as f:
        for rank in range(2):
            rd = reader_mod.Reader(plan, rank, 2, layout)
            seq = plan.sequences[1]
            monkeypatch.setattr(rd, "_moved", lambda n, rd=rd: moved.append(n))
            q, k, v = rd.read(seq)
            pos, pos_k = rd.positions(seq), rd.positions_k(seq)
            np.testing.assert_array_equal(q, f["s1/q"][...][pos])
            np.testing.assert_array_equal(k, f["s1/k"][...][pos_k])
            np.testing.assert_array_equal(v, f["s1/v"][...][pos_k])
            assert (rd.raw.direct.get(0) is not None) == (direct == "1")
            rd.close()
    assert sizes and max(sizes) <= 2 * direct_io.ALIGN, sizes
    assert len(moved) >= len(sizes)  # a sign of life after every transfer


def test_whole_sequence_reads_take_one_low_level_call(tmp_path, monkeypatch):
    """A rank holding whole sequences (a ring of one) reads each dataset in one call, the
    file's exact values; over the slab limit, or holding a share, it reads in slabs (HDF5's
    reads: sequences whose bytes' place the plan does not know)."""
    import dataclasses

    from h5py import h5d

    from ringmpi.job.input import scan as schema

    p = _data(tmp_path)
    plan = schema.scan([str(p)])
    plan.sequences = [dataclasses.replace(s, storage=None) for s in plan.sequences]
    slabs, whole = [], []
    real_direct, real_open = h5py.Dataset.read_direct, h5d.open

    def counted(self, dest, source_sel=None, dest_sel=None):
        slabs.append(dest.nbytes)
        return real_direct(self, dest, source_sel, dest_sel)

    def opened(*args, **kw):
        whole.append(args[1])
        return real_open(*args, **kw)

    monkeypatch.setattr(h5py.Dataset, "read_direct", counted)
    monkeypatch.setattr(h5d, "open", opened)
    with h5py.File(p, "r", locking=False) as f:
        for limit, want_whole in ((1 << 20, True), (1000, False)):
            slabs.clear(), whole.clear()
            monkeypatch.setattr(reader_mod, "SLAB_BYTES", limit)
            rd = reader_mod.Reader(plan, 0, 1, "zigzag")
            for seq in plan.sequences:
                q, k, v = rd.read(seq)
                for name, a in (("q", q), ("k", k), ("v", v)):
                    np.testing.assert_array_equal(a, f[f"{seq.group}/{name}"][...])
            assert rd.bytes_read == 2 * (q.nbytes + k.nbytes + v.nbytes)
            rd.close()
            if want_whole:
                assert sorted(whole) == sorted(f"s{i}/{n}".encode() for i in (0, 1) for n in "qkv")
                assert not slabs
            else:
                assert not whole and slabs and max(slabs) <= 1000


_ABANDON = """
import sys, time
from h5py._objects import phil
from ringmpi.job.input import reader
stuck = sys.argv[1] == "stuck"
def read():
    with phil:  # like a read blocked inside HDF5
        time.sleep(3600 if stuck else 0.2)
fut = reader.in_background(read)
time.sleep(0.1)
reader.abandon(7, [fut], grace=float(sys.argv[2]))
if sys.argv[3] == "lock":  # the main thread blocks on h5py's lock: only the timer helps
    with phil:
        pass
time.sleep(0.5)
print("left", flush=True)
"""


@pytest.mark.parametrize(
    "mode, grace, then, rc, out",
    [
        ("stuck", "60", "exit", 7, "left"),
        ("stuck", "1", "lock", 7, ""),
        ("done", "1", "lock", 0, "left"),
    ],
)
def test_abandoned_reads_never_keep_the_process(mode, grace, then, rc, out):
    """A stuck read: exit with the code at interpreter exit, or after the grace if the main
    thread is stuck on h5py's lock itself; a read that finished: a normal exit."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [PY, "-c", _ABANDON, mode, grace, then], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout.strip()) == (rc, out), proc.stderr
    assert time.monotonic() - t0 < 20
