"""Test helpers for ring-parallel code: the dense oracle, the tolerance rule, cross-rank asserts.

ringmpi's own pytest-mpi suites use these, and so can yours: check a layer built
on :func:`ringmpi.ring_attention` the same way.

Example (run with ``mpiexec -n 3 python -m mpi4py -m pytest -p ringmpi.pytest_plugin
--with-mpi test_mine.py``; the plugin, :data:`PYTEST_PLUGIN`, makes a failure on
one rank fail the test on every rank, or abort the job with its message when the
other ranks are stuck waiting for that rank, instead of hanging)::

    import numpy as np
    import pytest
    from mpi4py import MPI
    import ringmpi
    from ringmpi.testing import assert_all, assert_close, random_qkv, reference_pair

    @pytest.mark.mpi
    def test_my_layer():
        comm = MPI.COMM_WORLD
        q, k, v = random_qkv(np.random.default_rng(0), n=301, h=4, hkv=2, d=32, dtype=np.float32)
        shards = [ringmpi.shard(x, comm, layout="zigzag") for x in (q, k, v)]
        out = ringmpi.ring_attention(*shards, comm, causal=True, layout="zigzag")
        full = ringmpi.gather(out, len(q), comm, layout="zigzag")
        (ref, _), (peer, _) = reference_pair(q, k, v, causal=True)
        assert_close(comm, full, ref, peer, "out")

The rule: float64 results must be within 1e-12 (relative to ``max(1, |ref|)``) of
the dense float64 reference; lower precisions within ``factor`` times the error
of a dense computation in that precision (the peer), plus ``eps``. A tolerance
derived from the peer can fail: an error twice the peer's is a defect.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Callable

import numpy as np
from mpi4py import MPI

from . import reference

__all__ = [
    "lse_budget",
    "dense",
    "dense_backward",
    "reference_pair",
    "tolerance",
    "assert_close",
    "assert_all",
    "raises_everywhere",
    "once",
    "random_qkv",
    "REALISTIC",
    "PYTEST_PLUGIN",
]

#: the pytest plugin for multi-rank suites: ``pytest -p ringmpi.pytest_plugin``, or
#: ``pytest_plugins = [PYTEST_PLUGIN]`` in a conftest.py (see :mod:`ringmpi.pytest_plugin`)
PYTEST_PLUGIN = "ringmpi.pytest_plugin"

#: eps added to the peer-derived tolerance, by dtype
EPS = {"float16": 1e-4, "float32": 1e-6, "float64": 1e-12}


def dense(q, k, v, causal: bool = False, scale=None, dtype=np.float32, **mask):
    """Dense attention computed entirely in ``dtype``: the peer a ring result is judged against.

    ``mask``: window, cu_seqlens, cu_seqlens_k as in :func:`ringmpi.ring_attention`.
    """
    return reference.attention(q, k, v, causal, scale, dtype=dtype, **mask)


def dense_backward(dout, q, k, v, causal: bool = False, scale=None, dtype=np.float32, **mask):
    """Dense attention gradients computed entirely in ``dtype``: the peer for float32 results."""
    return reference.attention_backward(dout, q, k, v, causal, scale, dtype=dtype, **mask)


def reference_pair(q, k, v, causal: bool = False, scale=None, dtype=None):
    """(float64 reference (out, lse), dense peer (out, lse) in ``dtype`` or q's precision).

    For float64 inputs the peer is None (the rule is then relative to the reference).
    """
    dt = np.dtype(dtype or np.asarray(q).dtype)
    ref = reference.attention(q, k, v, causal, scale)
    if dt == np.float64:
        return ref, None
    return ref, dense(q, k, v, causal, scale, dtype=np.float32)  # float16 computes in float32


def tolerance(ref, peer=None, *, dtype="float32", factor: float = 2.0, rel: float = 1e-12) -> float:
    """Allowed max-abs error against ``ref``: ``factor * max|peer - ref| + eps`` or relative.

    Parameters
    ----------
    ref : array
        The float64 reference.
    peer : array, optional
        The same quantity computed densely in the working precision; None for
        float64 results, which must be within ``rel * max(1, max|ref|)``.
    dtype : str
        Working precision (picks ``eps``).
    factor : float
        How many times the peer's error a ring result may have (2 forward, 3 backward).
    """
    ref = np.asarray(ref, dtype=np.float64)
    fin = np.isfinite(ref)
    if peer is None:
        return rel * max(1.0, float(np.abs(ref[fin]).max(initial=0.0)))
    diff = np.abs(np.asarray(peer, dtype=np.float64)[fin] - ref[fin])
    return factor * float(diff.max(initial=0.0)) + EPS[str(np.dtype(dtype))]


def assert_all(comm, ok: bool, msg: str) -> None:
    """Fail on every rank together when any rank's condition is false (naming the ranks)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    ok_all = comm.allreduce(bool(ok), op=MPI.LAND)
    bad = comm.allgather(None if ok else msg)
    assert ok_all, "; ".join(f"rank {r}: {m}" for r, m in enumerate(bad) if m)


def assert_close(
    comm, got, ref, peer=None, name: str = "result", *, factor=2.0, extra: float = 0.0
) -> float:
    """Assert on every rank that ``got`` is within :func:`tolerance` of ``ref``; return err/tol.

    Infinite entries of ``ref`` (lse = -inf of an empty row) must match exactly.
    ``extra`` adds an error budget the peer does not have, e.g. for gradients that
    start from a float32 lse: ``max|lse - ref_lse| * max|ref|`` (p = exp(s - lse)
    turns the lse's absolute error into a relative error of every term).
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    dtype = "float64" if peer is None else "float32"
    tol = tolerance(ref, peer, dtype=dtype, factor=factor) + extra
    fin = np.isfinite(ref)
    err = float(np.abs(got[fin] - ref[fin]).max(initial=0.0))
    same_inf = bool(np.array_equal(got[~fin], ref[~fin]))
    assert_all(
        comm,
        err <= tol and same_inf,
        f"{name}: max err {err:.3g} > tol {tol:.3g}"
        if same_inf
        else f"{name}: infinite entries differ",
    )
    return err / tol


def lse_budget(lse, ref_lse, ref) -> float:
    """The ``extra`` of :func:`assert_close` for gradients computed from a rounded ``lse``."""
    lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
    fin = np.isfinite(ref_lse)
    err = float(np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0))
    return err * float(np.abs(np.asarray(ref, np.float64)).max(initial=0.0))


def raises_everywhere(comm, fn: Callable[[], object], *words: str) -> str:
    """Every rank must raise ValueError with one identical message containing ``words``."""
    try:
        fn()
        msg = None
    except ValueError as exc:
        msg = str(exc)
    msgs = comm.allgather(msg)
    assert_all(comm, msg is not None, "no ValueError raised on this rank")
    assert_all(comm, len(set(msgs)) == 1, f"ranks raised different messages: {msgs}")
    for w in words:
        assert_all(comm, w in msg, f"{w!r} missing from {msg!r}")
    return msg


#: means and spreads of q, k, v shaped like a trained model's activations (biases, positive
#: features): ``random_qkv(..., realistic=True)``. Zero-mean normals let float32 rounding
#: errors cancel; these do not (a value mean makes every row's running sums grow).
REALISTIC = {"means": (0.0, 0.5, 1.0), "spreads": (1.0, 1.0, 0.1), "sinks": 2}


def random_qkv(
    rng,
    n: int,
    h: int,
    hkv: int,
    d: int,
    batch=None,
    dtype=np.float64,
    *,
    realistic: bool = False,
    means=None,
    spreads=None,
    sinks=None,
    nk=None,
    dv=None,
):
    """Global q (n, h, d), k (nk, hkv, d) and v (nk, hkv, dv), with a leading batch axis if given.

    Parameters
    ----------
    rng : numpy.random.Generator
    n, h, hkv, d : int
        Query tokens, query heads, key/value heads, head size.
    batch : int, optional
        Leading batch axis.
    dtype : numpy dtype
    realistic : bool
        Default ``means``, ``spreads`` and ``sinks`` from :data:`REALISTIC` instead of
        standard normals (0, 1, no sinks).
    means, spreads : (float, float, float), optional
        Mean and standard deviation of q, k, v (each entry normal).
    sinks : int, optional
        Keys (evenly spread, the first at position 0) scaled to 8 times their norm, as the
        large-norm "attention sink" keys of trained models.
    nk : int, optional
        Key/value tokens, default n (cross-attention when different).
    dv : int, optional
        Value width, default d (keys and values of different widths: multi-head
        latent attention).

    Returns
    -------
    q : (n, h, d), k : (nk, hkv, d), v : (nk, hkv, dv), or with the batch axis first.
    """
    preset = REALISTIC if realistic else {"means": (0.0,) * 3, "spreads": (1.0,) * 3, "sinks": 0}
    means = preset["means"] if means is None else means
    spreads = preset["spreads"] if spreads is None else spreads
    sinks = preset["sinks"] if sinks is None else int(sinks)
    nk = n if nk is None else int(nk)
    lead = () if batch is None else (batch,)
    dv = d if dv is None else int(dv)
    shapes = ((*lead, n, h, d), (*lead, nk, hkv, d), (*lead, nk, hkv, dv))
    q, k, v = (mu + sd * rng.standard_normal(shp) for mu, sd, shp in zip(means, spreads, shapes))
    if sinks and nk:
        k[..., np.linspace(0, nk - 1, min(sinks, nk)).astype(int), :, :] *= 8.0
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


#: results :func:`once` keeps on rank 0, by the SHA-256 of the call (oldest dropped first)
_ONCE: OrderedDict = OrderedDict()
_ONCE_KEEP = 24


def _call_key(fn: Callable, args, kwargs) -> str:
    """SHA-256 of a call: the function's name and every argument's type, shape and bytes."""
    h = hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}".encode())
    for name, x in [(i, a) for i, a in enumerate(args)] + sorted(kwargs.items()):
        h.update(f"|{name}=".encode())
        if isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x)
            h.update(f"ndarray {a.dtype.str} {a.shape}:".encode())
            h.update(a.reshape(-1).view(np.uint8).tobytes())
        elif isinstance(x, dict):
            h.update(_call_key(dict, (), x).encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def _frozen(result):
    """Arrays in ``result`` made read-only: a kept oracle must not be edited in place."""
    if isinstance(result, np.ndarray):
        result.setflags(write=False)
    elif isinstance(result, (tuple, list)):
        for x in result:
            _frozen(x)
    return result


def once(comm, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` computed on rank 0 of ``comm`` and sent to every rank.

    For oracles that depend only on global inputs every rank holds (the dense float64
    reference of a whole sequence, say): computed on every rank, they cost P times
    the work, and ranks that share cores slow each other down. Rank 0 also keeps
    the last results by the SHA-256 of the call (function, argument types, shapes
    and bytes), so a suite that checks several layouts of the same inputs computes
    the oracle once. The other ranks wait without spinning. Returned arrays are
    read-only. An exception in ``fn`` is raised on every rank (as RuntimeError on
    the others, naming it).

    Example::

        ref, ref_lse = once(comm, reference.attention, q, k, v, True)
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    outcome = None
    if comm.Get_rank() == 0:
        key = _call_key(fn, args, kwargs)
        if key in _ONCE:
            _ONCE.move_to_end(key)
            outcome = ("ok", _ONCE[key])
        else:
            try:
                outcome = ("ok", _frozen(fn(*args, **kwargs)))
                _ONCE[key] = outcome[1]
                while len(_ONCE) > _ONCE_KEEP:
                    _ONCE.popitem(last=False)
            except Exception as exc:  # every rank must learn of it, or they wait forever
                outcome = ("error", exc)
    if comm.Get_size() > 1:
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.001)
        sent = outcome if outcome is None or outcome[0] == "ok" else ("error", repr(outcome[1]))
        got = comm.bcast(sent if comm.Get_rank() == 0 else None, root=0)
        outcome = outcome if comm.Get_rank() == 0 else got
        if comm.Get_rank() != 0:
            outcome = (outcome[0], _frozen(outcome[1]))
    kind, value = outcome
    if kind == "error":
        if comm.Get_rank() == 0:
            raise value
        raise RuntimeError(f"once({fn.__qualname__}) failed on rank 0: {value}")
    return value
