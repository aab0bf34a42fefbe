"""A pytest plugin that keeps multi-rank test suites from hanging when one rank fails.

Run a suite under MPI with it::

    mpiexec -n 4 python -m pytest -p ringmpi.pytest_plugin --with-mpi tests/

(or ``pytest_plugins = ["ringmpi.pytest_plugin"]`` in the suite's conftest.py).
After each test every rank takes part in one agreement on a communicator of its
own. When a test failed on some ranks:

* every rank is still there (the others passed or failed on their own): the
  test fails on every rank, each report naming the rank(s) and their first
  error line, and the suite goes on;
* some rank does not arrive within ``--mpi-agree-timeout`` seconds (default 10,
  or ``RINGMPI_TEST_AGREE_S``): it is stuck inside the test, typically in a
  collective waiting for the rank that raised. The failed rank then prints its
  error to the terminal, past pytest's output capture, and aborts the MPI job
  (exit status 1): the job ends within the timeout instead of hanging until the
  batch system kills it.

On one rank (or without MPI initialised by the suite) the plugin does nothing.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_runtest_makereport"]

_STATE: dict = {"comm": None, "timeout": 10.0, "config": None}


def pytest_addoption(parser) -> None:
    """``--mpi-agree-timeout S``: seconds a failed rank waits for the others after a test."""
    parser.addoption(
        "--mpi-agree-timeout",
        type=float,
        default=None,
        help="ringmpi.pytest_plugin: seconds a rank whose test failed waits for the other "
        "ranks before it aborts the MPI job with its message (default 10, or "
        "RINGMPI_TEST_AGREE_S)",
    )


def pytest_configure(config) -> None:
    """Set the plugin up when the suite runs on more than one MPI rank."""
    from .runtime.launch import launcher_tasks

    launched = (launcher_tasks(os.environ).tasks or 1) > 1
    if not launched and "mpi4py.MPI" not in sys.modules:
        return  # a plain pytest run: do not initialise MPI for it
    try:
        from mpi4py import MPI  # under a launcher: initialises MPI now, before collection
    except ImportError:
        return
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return
    timeout = config.getoption("--mpi-agree-timeout")
    if timeout is None:
        timeout = float(os.environ.get("RINGMPI_TEST_AGREE_S", "10"))
    _STATE.update(comm=MPI.COMM_WORLD.Dup(), timeout=float(timeout), config=config)


def _first_line(report) -> str:
    """The error of a failed report in one line (its crash message, else its first 'E' line)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message.strip().splitlines()[0][:300]
    text = str(report.longrepr) if report.longrepr is not None else ""
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = errors or [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "failed")[:300]


def _abort(comm, report, line: str) -> None:
    """Print past the capture and abort the job: some rank never finished the test."""
    capman = _STATE["config"].pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    t = _STATE["timeout"]
    sys.stderr.write(
        f"\nringmpi.pytest_plugin: {report.nodeid} failed on rank {comm.Get_rank()}: {line}\n"
        f"ringmpi.pytest_plugin: other ranks did not finish the test within {t:g} s (stuck "
        "waiting for this rank?): aborting the MPI job\n"
    )
    sys.stderr.flush()
    time.sleep(0.3)  # let the launcher forward the lines before the abort tears the job down
    comm.Abort(1)


def _agree(report) -> None:
    """One agreement per test: fail it on every rank, or abort when a rank is stuck."""
    comm = _STATE["comm"]
    failed = bool(report.failed)
    line = _first_line(report) if failed else ""
    req = comm.Ibarrier()
    deadline = time.monotonic() + _STATE["timeout"]
    while not req.Test():
        if failed and time.monotonic() > deadline:
            _abort(comm, report, line)
        time.sleep(0.002)
    outcomes = comm.allgather((failed, line))
    bad = [(r, text) for r, (f, text) in enumerate(outcomes) if f]
    if bad and not failed:
        ranks = ", ".join(str(r) for r, _ in bad)
        report.outcome = "failed"
        report.longrepr = f"failed on rank(s) {ranks}: {bad[0][1]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Agree once per test: after its call, or after a setup that did not pass (no call)."""
    outcome = yield
    if _STATE["comm"] is None:
        return
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _agree(report)
