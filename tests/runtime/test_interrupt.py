"""Ctrl-C in the library: ring_attention stops promptly, from inside the kernels too.

A timer thread sends SIGINT to this process while ring_attention runs. The call
must raise KeyboardInterrupt within a second or so (the fused kernel calls its
progress callback every 512 query rows), print no "Exception ignored" from
ctypes, leave no transfer in flight, and the next call must work and be right.
Multi-rank: every rank interrupts itself during the same long call.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringmpi import reference, ring, ring_attention, shard
from ringmpi.runtime import interrupt
from ringmpi.testing import assert_all

LONG = (6144, 8, 64)  # S, H, D: tenths of a second of kernel time, many progress ticks


def _qkv(s, h, d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((s, h, d)).astype("f4") for _ in range(3)]


def _interrupted_call(comm, capfd=None):
    """Run a long ring_attention; SIGINT at its first progress tick; seconds from signal to raise.

    The signal is sent from inside the kernel's progress callback (``on_tick``), so it
    always lands while a tile runs, however fast this machine computes the call.
    """
    s, h, d = LONG
    q, k, v = (shard(x, comm) for x in _qkv(s, h, d))
    sent = []

    def tick(step):
        if not sent:
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)

    comm.Barrier()
    with pytest.raises(KeyboardInterrupt):
        ring_attention(q, k, v, comm, on_tick=tick)
    assert sent, "the kernel never reported progress"
    return time.perf_counter() - sent[0]


def _check_next_call_right(comm):
    q, k, v = _qkv(300, 2, 16, seed=3)
    out = ring_attention(*(shard(x, comm) for x in (q, k, v)), comm, causal=True)
    ref, _ = reference.attention(q, k, v, causal=True)
    err = float(np.abs(out - shard(ref, comm)).max())
    return err


def test_sigint_stops_ring_attention_in_the_kernel(capfd):
    comm = MPI.COMM_SELF
    secs = _interrupted_call(comm)
    err = capfd.readouterr().err
    assert secs < 2.0, secs
    assert "Exception ignored" not in err, err
    assert ring.abandoned() == 0
    assert interrupt.pending() is None and not interrupt.active()
    # the default handler is back: outside a call, Ctrl-C is a plain KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _check_next_call_right(comm) < 1e-5


def test_program_handler_is_left_alone():
    seen = []
    old = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    try:
        q, k, v = _qkv(64, 1, 8)
        ring_attention(q, k, v, MPI.COMM_SELF)
        assert signal.getsignal(signal.SIGINT) is not interrupt._handler
        with interrupt.catching():
            assert not interrupt.active()  # a program's own handler is not replaced
    finally:
        signal.signal(signal.SIGINT, old)


def test_flag_raised_at_the_end_of_the_block_is_not_lost():
    with pytest.raises(interrupt.Interrupted) as e:
        with interrupt.catching((signal.SIGINT, signal.SIGTERM)):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs; nothing checks inside the block
    assert e.value.exit_status == 143 and isinstance(e.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.mpi
def test_sigint_on_every_rank_stops_and_frees(comm):
    secs = _interrupted_call(comm)
    worst = max(comm.allgather(secs))
    assert_all(comm, worst < 3.0, f"interrupt took {worst:.2f} s")
    left = comm.allgather(ring.abandoned())
    assert_all(comm, sum(left) == 0, f"transfers left in flight: {left}")
    comm.Barrier()
    err = max(comm.allgather(_check_next_call_right(comm)))
    assert_all(comm, err < 1e-5, f"next call wrong: {err}")


# -- the backstop: a signal the main thread cannot act on still ends the process ---------------

_BLOCKED = """
import os, signal, sys, time
from ringmpi.runtime import interrupt
r, w = os.pipe()
with interrupt.catching((signal.SIGINT, signal.SIGTERM)):
    print("ready", flush=True)
    if sys.argv[1] == "blocked":
        os.read(r, 1)  # like a rank stuck in MPI: the handler runs, nobody checks the flag
    else:  # checks at safe points, takes the interrupt, then works on past the grace
        try:
            while True:
                interrupt.check()
                time.sleep(0.05)
        except interrupt.Interrupted:
            time.sleep(3)
            print("cleaned up", flush=True)
"""


def _start_blocked(mode: str, grace: str):
    import subprocess
    import sys

    env = dict(os.environ, RINGMPI_INTERRUPT_GRACE_S=grace)
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_not_acted_on_ends_the_process_after_the_grace(sig):
    proc = _start_blocked("blocked", "1")
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert 0.9 < took < 10, took
    assert f"{signal.Signals(sig).name} not acted on within 1 s" in err, err


def test_signal_raised_at_a_safe_point_is_left_to_the_program():
    proc = _start_blocked("checks", "1")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "cleaned up" in out, (proc.returncode, out, err)
    assert "not acted on" not in err


def test_backstop_off_and_wakeup_fd_given_back():
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    with interrupt.catching():
        mine = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(mine)
        assert mine != -1, "the backstop holds the wakeup fd while catching"
    after = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(after)
    assert after == before
    os.environ[interrupt.GRACE_ENV] = "0"
    try:
        with interrupt.catching():
            held = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(held)
            assert held == before, "RINGMPI_INTERRUPT_GRACE_S=0 turns the backstop off"
    finally:
        del os.environ[interrupt.GRACE_ENV]
