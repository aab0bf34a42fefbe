"""Collective helpers: one error, raised the same way on every rank; root-only work.

A rank that raised alone would leave the others waiting in MPI forever. So every
step that can fail on some ranks is followed by an agreement: each rank reports
its problem (or None); a polled reduction (:func:`any_rank`, which notices Ctrl-C while
it waits) tells every rank whether any failed, and only then one ``allgather`` tells
every rank all the problems, each raising the first one, with the same message and
type, naming the rank where that helps. ``comm=None`` means a single process (no MPI
calls at all).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from .runtime import interrupt
from .runtime.watchdog import watch

__all__ = [
    "CollectiveError",
    "agree_views",
    "first_error",
    "raise_first",
    "run_everywhere",
    "run_on_root",
    "any_rank",
]

# keyval of the private duplicate each communicator agrees on (:func:`any_rank`), and the
# duplicates whose barrier an interrupt left pending: a nonblocking collective may be
# neither freed nor cancelled (MPI), so those stay referenced until the process ends
_KEYVAL = None
_LEFT: list = []


class CollectiveError(ValueError):
    """A problem raised with the identical one-line message on every rank."""


def first_error(errors: list, what: Optional[str] = None) -> Optional[str]:
    """The message of the first rank with an error, or None.

    Parameters
    ----------
    errors : list of (str or None)
        One entry per rank, in rank order.
    what : str, optional
        Prefix "WHAT: rank R: " (the rank that failed first); without it the
        message is used as it is (it already names its file or rank).

    Returns
    -------
    str or None
        ``"... (and N more rank(s))"`` when several ranks failed.
    """
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return None
    r, msg = bad[0]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return (f"{what}: rank {r}: " if what else "") + f"{msg}{more}"


def any_rank(comm, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank of ``comm``; notices Ctrl-C meanwhile.

    The agreements start here. A rank that finished its share early waits for the
    others in a polled ``Iallreduce`` rather than inside a blocking collective, where
    Python could not run the signal handler: so when mpiexec forwards Ctrl-C to every
    rank, each raises :class:`~ringmpi.runtime.interrupt.Interrupted` within
    milliseconds (under ``ringmpi run``) and the job leaves cleanly, instead of the
    early rank sitting in MPI until the others abort the job. The reduction runs on a
    private duplicate of ``comm`` (made once, cached as an MPI attribute of ``comm``),
    so one left pending by an interrupt never meets a later collective of the caller.
    One rank, or ``comm=None``: ``flag`` itself, no MPI call.
    """
    if comm is None or comm.Get_size() == 1:
        return bool(flag)
    from mpi4py import MPI

    dup = _meeting_comm(comm)
    mine, total = np.array([int(bool(flag))], np.int32), np.zeros(1, np.int32)
    req = dup.Iallreduce(mine, total, op=MPI.MAX)
    # spin about 2 ms (the ranks of a balanced ring arrive together), then nap: 50 us
    # doubling to 1 ms, so a longer wait leaves the core to other ranks and costs at most
    # a millisecond of latency
    spin_until, nap = time.monotonic() + 2e-3, 5e-5
    while not req.Test():
        if interrupt.pending() is not None:
            _LEFT.append((dup, req, mine, total))
            interrupt.check()
        if time.monotonic() > spin_until:
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)
    return bool(total[0])


def _meeting_comm(comm):
    """The duplicate of ``comm`` that :func:`any_rank` uses (collective the first time)."""
    global _KEYVAL
    from mpi4py import MPI

    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_meeting_comm)
    dup = comm.Get_attr(_KEYVAL)
    if dup is None:
        dup = comm.Dup()
        comm.Set_attr(_KEYVAL, dup)
    return dup


def _free_meeting_comm(_comm, _keyval, dup) -> None:
    """``comm`` is being freed: free its duplicate unless a barrier on it is pending."""
    from mpi4py import MPI

    if MPI.Is_finalized() or any(left[0] is dup for left in _LEFT):
        return
    try:
        dup.Free()
    except MPI.Exception:
        pass


def raise_first(comm, err: Optional[str], what: str, error: type = ValueError) -> None:
    """Gather every rank's ``err``; raise ``error`` with the first one on every rank."""
    with watch(f"{what}: the error agreement with the other ranks"):
        failed = any_rank(comm, err is not None)
        errors = comm.allgather(err) if failed and comm is not None else [err]
    msg = first_error(errors, what)
    if msg is not None:
        raise error(msg)


def agree_views(comm, view: dict, what: str, keys: tuple = ()) -> list:
    """One ``allgather`` of every rank's view; the same ValueError everywhere on any problem.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm or None
        None: a single process (no MPI call).
    view : dict
        This rank's description of the call; ``view["error"]`` is its local
        problem (a str) or None.
    what : str
        The caller's name, the prefix of every message.
    keys : tuple of str
        Entries every rank must hold equal (named as they are in the message).

    Returns
    -------
    list of dict
        Every rank's view, in rank order (only when nothing is wrong).
    """
    with watch(f"{what}: the argument agreement (allgather) with the other ranks"):
        views = [view] if comm is None else comm.allgather(view)
    msg = first_error([v.get("error") for v in views], what)
    if msg is None:
        first = views[0]
        for key in keys:
            bad = [r for r, v in enumerate(views) if v.get(key) != first.get(key)]
            if bad:
                msg = (
                    f"{what}: ranks disagree on {key}: rank 0 has {_short(first.get(key))}, "
                    f"rank {bad[0]} has {_short(views[bad[0]].get(key))}"
                )
                break
    if msg is not None:
        raise ValueError(msg)
    return views


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 4] + " ..."


def run_everywhere(comm, fn: Callable, *args, **kwargs) -> Any:
    """Call ``fn`` on every rank; if it fails anywhere, raise the same error everywhere.

    A :class:`CollectiveError` (or subclass) raised by ``fn`` keeps its type and
    message, which already name the file or the problem. Any other exception
    becomes a CollectiveError "TypeName: message", prefixed with "rank r: "
    when there is more than one rank. Only the calling (main) thread uses MPI.
    """
    err = None
    try:
        result = fn(*args, **kwargs)
    except CollectiveError as e:
        err, result = (type(e), str(e)), None
    except Exception as e:  # noqa: BLE001 - any local failure becomes a collective error
        text = f"{type(e).__name__}: {e}".splitlines()[0]
        if comm is not None and comm.Get_size() > 1:
            text = f"rank {comm.Get_rank()}: {text}"
        err, result = (CollectiveError, text), None
    with watch(f"the agreement after {getattr(fn, '__name__', 'a step')} with the other ranks"):
        failed = any_rank(comm, err is not None)
        errs = comm.allgather(err) if failed and comm is not None else [err]
    bad = [e for e in errs if e is not None]
    if bad:
        kind, text = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise kind(text + more)
    return result


def run_on_root(comm, fn: Callable, *args, **kwargs) -> Any:
    """Rank 0 calls ``fn``, the others wait; every rank gets its result or the same error."""
    rank = 0 if comm is None else comm.Get_rank()
    result = run_everywhere(comm, fn if rank == 0 else _nothing, *args, **kwargs)
    if comm is None:
        return result
    with watch(f"rank 0's result of {getattr(fn, '__name__', 'a step')}"):
        return comm.bcast(result, root=0)


def _nothing(*_args, **_kwargs) -> None:
    return None
