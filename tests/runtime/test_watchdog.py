"""The watchdog: a rank waiting on a silent peer ends the job with one line, within the limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ringmpi.runtime import watchdog

MPIEXEC = Path(sys.executable).parent / "mpiexec"

# rank 1 hangs (a peer that never sends) while rank 0 waits in the ring or in an agreement
SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from mpi4py import MPI
    import ringmpi
    from ringmpi.backend import select
    from ringmpi.ring import KVRing
    comm = MPI.COMM_WORLD
    x = np.ones((64 * comm.size, 2, 16), dtype=np.float32)
    loc = ringmpi.shard(x, comm)
    if sys.argv[1] == "ring":
        kv_local = np.ascontiguousarray(loc[None].swapaxes(1, 2))
        with KVRing(comm, select(loc), kv_local, kv_local, [64] * comm.size) as kv:
            if comm.rank == 1:
                time.sleep(120)  # never sends its block
            for _ in kv:
                pass
    else:
        if comm.rank == 1:
            time.sleep(120)  # never joins the argument agreement
        ringmpi.ring_attention(loc, loc, loc, comm)
    """
)


def test_limit_parsing(monkeypatch):
    monkeypatch.delenv(watchdog.ENV, raising=False)
    assert watchdog.limit() == watchdog.DEFAULT_S
    monkeypatch.setenv(watchdog.ENV, "0")
    assert watchdog.limit() is None
    monkeypatch.setenv(watchdog.ENV, "2.5")
    assert watchdog.limit() == 2.5
    monkeypatch.setenv(watchdog.ENV, "soon")
    with pytest.raises(ValueError, match=watchdog.ENV):
        watchdog.limit()


def test_watch_returns_normally_inside_the_limit(monkeypatch):
    monkeypatch.setenv(watchdog.ENV, "5")
    with watchdog.watch("nothing"):
        time.sleep(0.05)
    time.sleep(0.1)  # a disarmed watchdog never fires


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec beside this Python")
@pytest.mark.parametrize("where", ["ring", "agreement"])
def test_silent_peer_ends_the_job(tmp_path, where):
    script = tmp_path / "hang.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGMPI_WATCHDOG_S="2")
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", str(script), where]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    took = time.monotonic() - t0
    assert res.returncode != 0
    assert took < 20, f"job took {took:.1f} s with a 2 s watchdog"
    text = res.stdout + res.stderr
    want = "ring step 0: the K/V block from rank 1" if where == "ring" else "argument agreement"
    assert "ringmpi: watchdog: rank 0 waited more than 2 s for" in text, text[-2000:]
    assert want in text, text[-2000:]
