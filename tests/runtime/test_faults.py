"""ringmpi.runtime.faults: the one fault-injection seam (issue 38).

Each point fires only when its variable names this rank and this moment, does nothing
when unset, and no other module of the package reads a fault variable.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

import ringmpi
from ringmpi.runtime import env, faults

PKG = Path(ringmpi.__file__).parent
POINTS = [
    faults.RING_STEP,
    faults.KILL_AFTER,
    faults.KILL_IN_BATCH,
    faults.KILL_AT_STEP,
    faults.MPIO_KILL,
    faults.READ_STALL,
]


@pytest.fixture
def kills(monkeypatch):
    """Signals the seam would send to this process, recorded instead of sent."""
    sent: list = []
    monkeypatch.setattr(faults, "_kill", lambda sig=signal.SIGKILL: sent.append(sig))
    for name in POINTS:
        monkeypatch.delenv(name, raising=False)
    return sent


def test_every_point_is_registered_and_read_only_here():
    for name in POINTS:
        assert name in env.REGISTRY and env.REGISTRY[name].tests, name
    readers = sorted(
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.name not in ("faults.py", "env.py")
        and any(re.search(rf"\b{n}\b", p.read_text()) for n in POINTS)
    )
    # reader.py names its variable in the docstring only (the stall it emulates)
    assert readers in ([], ["job/input/reader.py"]), readers
    for p in PKG.rglob("*.py"):
        if p.name != "faults.py":
            assert not re.search(rf"environ[^\n]*({'|'.join(POINTS)})", p.read_text()), p


def test_nothing_happens_unset(kills):
    faults.ring_step(0, 0)
    faults.sequences_done(0, 10**6)
    faults.batch_read(0, 0)
    faults.checkpoint_step(None, 0, 0, 0)
    faults.rows_written(0, 0)
    t0 = time.monotonic()
    faults.read(0)
    assert kills == [] and time.monotonic() - t0 < 0.5


def test_ring_step_raises_on_that_rank_and_step_only(monkeypatch, kills):
    monkeypatch.setenv(faults.RING_STEP, "1:2")
    faults.ring_step(0, 2)
    faults.ring_step(1, 1)
    with pytest.raises(RuntimeError, match="injected fault on rank 1 at ring step 2"):
        faults.ring_step(1, 2)


def test_kills_fire_on_rank_zero_at_their_moment(monkeypatch, kills):
    monkeypatch.setenv(faults.KILL_AFTER, "3")
    faults.sequences_done(0, 2)
    faults.sequences_done(1, 3)
    assert kills == []
    faults.sequences_done(0, 3)
    assert kills == [signal.SIGKILL]
    monkeypatch.setenv(faults.KILL_IN_BATCH, "4")
    faults.batch_read(0, 3)
    faults.batch_read(0, 4)
    monkeypatch.setenv(faults.MPIO_KILL, "0")
    faults.rows_written(1, 0)
    faults.rows_written(0, 0)
    assert kills == [signal.SIGKILL] * 3


def test_checkpoint_step_passes_the_barrier_then_kills(monkeypatch, kills):
    class Ring:
        barriers = 0

        def Barrier(self):
            self.barriers += 1

    ring = Ring()
    monkeypatch.setenv(faults.KILL_AT_STEP, "2:1")
    faults.checkpoint_step(ring, 0, 2, 0)
    faults.checkpoint_step(ring, 0, 1, 1)
    assert kills == [] and ring.barriers == 0
    faults.checkpoint_step(ring, 1, 2, 1)  # not rank 0: the barrier only
    faults.checkpoint_step(ring, 0, 2, 1)
    assert kills == [signal.SIGKILL] and ring.barriers == 2
    monkeypatch.setenv(faults.KILL_AT_STEP, "2:1:TERM")
    faults.checkpoint_step(None, 3, 2, 1)  # every rank, one-rank ring
    assert kills == [signal.SIGKILL, signal.SIGTERM]


def test_read_stall_on_the_named_rank(monkeypatch, kills):
    monkeypatch.setenv(faults.READ_STALL, "1:0.3")
    t0 = time.monotonic()
    faults.read(0)
    assert time.monotonic() - t0 < 0.2
    faults.read(1)
    assert time.monotonic() - t0 >= 0.3
    monkeypatch.setenv(faults.READ_STALL, "nonsense")
    with pytest.raises(ValueError):
        faults.read(0)
