"""The in-job half of the stress checks: run under ``mpiexec -n P python -m mpi4py``.

``python -m mpi4py tests/mpi_checks.py MODE [ARGS]`` runs one check on
COMM_WORLD and rank 0 prints one JSON line prefixed with ``RESULT `` that
tests/stress.py and tests/test_stress.py parse. Modes:

call                one ring_attention call (the fault hook RINGMPI_TEST_FAULT
                    set by the launcher makes one rank raise mid-ring)
tile-fault R S      one call where rank R's tile kernel raises at ring step S,
                    after that step's exchange is posted (transfers in flight)
numerics            large logits, all-equal keys, one visible key vs the reference
finite              check_finite=True with a NaN on the last rank: every rank raises
soak N              N consecutive calls: leaked requests, communicators, RSS, bytes
oversub N           correctness of every layout, causal and not, at this P

The numerics cases are also used by tests/test_attention_numerics_mpi.py.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import weakref

import numpy as np
from mpi4py import MPI

import ringmpi  # noqa: E402
from ringmpi import reference  # noqa: E402
from ringmpi import ring as ring_mod  # noqa: E402
from ringmpi.testing import dense  # noqa: E402

__all__ = ["numerics_cases", "numerics_case", "soak", "oversub", "finite"]


def _say(comm: MPI.Comm, obj: dict) -> None:
    if comm.rank == 0:
        print("RESULT " + json.dumps(obj), flush=True)


def _rss() -> int:
    """Resident memory of this process now, in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _qkv(n: int, h: int = 4, hkv: int = 2, d: int = 16, seed: int = 3):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, h, d)),
        rng.standard_normal((n, hkv, d)),
        rng.standard_normal((n, hkv, d)),
    )


def numerics_cases() -> list:
    """Names of the hostile-numerics cases (see :func:`numerics_case`)."""
    return ["logits-1e3", "equal-keys", "one-visible-key"]


def numerics_case(comm: MPI.Comm, name: str, dtype, layout: str) -> dict:
    """Run one hostile-numerics case on ``comm``; every rank gets the same verdict.

    logits-1e3       scores scaled by 1e3 (|logit| ~ 1e3): exp must never overflow.
    equal-keys       every key identical: the softmax is uniform over visible keys.
    one-visible-key  causal: query 0 sees only key 0, so out[0] = v[0] exactly
                     and lse[:, 0] = q0.k0 * scale.

    Returns {"err", "tol", "lerr", "ltol", "finite", "exact"} where err/lerr are
    max |ring - ref64| of out/lse and tol/ltol the allowed error (1e-12 relative
    for float64; twice a dense float32 computation's error + 1e-6 for float32).
    """
    n = 61 * comm.size + 5
    q, k, v = _qkv(n)
    d = q.shape[-1]
    scale, causal = None, False
    if name == "logits-1e3":
        scale, causal = 1e3 / np.sqrt(d), True
    elif name == "equal-keys":
        k[:] = k[0]
    elif name == "one-visible-key":
        causal = True
    else:
        raise ValueError(name)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale)
    loc = [ringmpi.shard(x, comm, layout) for x in (q, k, v)]
    out, lse = ringmpi.ring_attention(
        *loc, comm, causal=causal, layout=layout, scale=scale, return_lse=True
    )
    full = ringmpi.gather(out, n, comm, layout)
    full_lse = ringmpi.gather(lse, n, comm, layout, axis=-1)
    finite = bool(np.isfinite(full).all() and np.isfinite(full_lse).all())
    err = float(np.abs(full - ref).max())
    lerr = float(np.abs(full_lse - ref_lse).max())
    if np.dtype(dtype) == np.float64:
        tol = 1e-12 * max(1.0, float(np.abs(ref).max()))
        ltol = 1e-12 * max(1.0, float(np.abs(ref_lse).max()))
    else:
        d_out, d_lse = dense(q, k, v, causal, scale)
        tol = 2 * float(np.abs(d_out - ref).max()) + 1e-6
        ltol = 2 * float(np.abs(d_lse - ref_lse).max()) + 1e-6
    exact = True
    if causal:  # a row with exactly one visible key: weight 1 on v[0], bit for bit
        hkv = k.shape[1]
        g = q.shape[1] // hkv
        exact = bool(all(np.array_equal(full[0, h], v[0, h // g]) for h in range(q.shape[1])))
    return {"err": err, "tol": tol, "lerr": lerr, "ltol": ltol, "finite": finite, "exact": exact}


def numerics(comm: MPI.Comm) -> dict:
    """Every numerics case x dtype x layout; the worst err/tol ratio."""
    worst, n, ok, bad = 0.0, 0, True, []
    for name in numerics_cases():
        for dt in (np.float32, np.float64):
            for layout in ringmpi.LAYOUTS:
                r = numerics_case(comm, name, dt, layout)
                n += 1
                ratio = max(r["err"] / r["tol"], r["lerr"] / r["ltol"])
                worst = max(worst, ratio)
                good = r["finite"] and r["exact"] and ratio <= 1
                if not good:
                    ok = False
                    bad.append(f"{name}/{np.dtype(dt).name}/{layout}: {r}")
    return {"ok": ok, "cases": n, "worst_ratio": worst, "bad": bad[:3]}


def finite(comm: MPI.Comm) -> dict:
    """check_finite=True with one NaN on the last rank: count ranks that raised."""
    q, k, v = _qkv(17 * comm.size)
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    if comm.rank == comm.size - 1:
        loc[0][0, 0, 0] = np.nan
    t0 = time.perf_counter()
    try:
        ringmpi.ring_attention(*loc, comm, check_finite=True)
        raised, msg = False, ""
    except ValueError as e:
        raised, msg = True, str(e)
    secs = time.perf_counter() - t0
    flags = comm.allgather(raised and "NaN" in msg)
    return {"ok": all(flags), "raised": int(sum(flags)), "ranks": comm.size, "s": secs}


class _Track:
    """Wrap Ring so every request and Cartesian communicator it creates can be audited."""

    def __init__(self):
        self.requests: list = []
        self.rings: list = []
        self.unfreed = 0
        self.pending_at_free = 0
        orig_init, orig_start, orig_free = (
            ring_mod.Ring.__init__,
            ring_mod.Ring.start,
            ring_mod.Ring.free,
        )
        track = self

        def init(ring, comm):
            orig_init(ring, comm)
            track.rings.append(weakref.ref(ring))

        def start(ring, send, recv, tag=ring_mod.TAG_KV):
            orig_start(ring, send, recv, tag)
            track.requests.extend(ring.requests[-2:])

        def free(ring):
            orig_free(ring)
            track.pending_at_free += len(ring.requests)
            track.unfreed += ring.cart != MPI.COMM_NULL

        ring_mod.Ring.__init__, ring_mod.Ring.start, ring_mod.Ring.free = init, start, free

    def live_requests(self) -> int:
        """Requests that still hold an MPI handle (not completed and released)."""
        live = sum(r != MPI.REQUEST_NULL for r in self.requests)
        self.requests.clear()
        return int(live)


def _trimmed_rss() -> int:
    """RSS after glibc returns its free heap pages to the system (malloc_trim); the plain RSS
    where that is not available. Growth that vanishes here is allocator slack, not a leak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss()


def _gc_requests() -> int:
    """mpi4py Request objects the garbage collector can still see (alive anywhere)."""
    return sum(isinstance(o, MPI.Request) for o in gc.get_objects())


def soak(comm: MPI.Comm, calls: int, warm: int = 50) -> dict:
    """``calls`` consecutive ring_attention calls at this P: leaks, memory, repeatability.

    Figures: requests posted by the ring that still hold an MPI handle after
    their call, Ring objects still alive and Cartesian communicators not freed
    (a leak of those would exhaust MPICH's ~2046 context ids: the full check
    runs past that), RSS after ``warm`` calls vs at the end (the check: < 1%; also
    after malloc_trim, which separates allocator slack from a leak), and whether
    every result is bitwise identical to the first.
    """
    track = _Track()
    q, k, v = _qkv(128 * comm.size + 3, h=4, hkv=2, d=32, seed=11)
    loc = [ringmpi.shard(x.astype(np.float32), comm) for x in (q, k, v)]
    first = None
    live = 0
    identical = True
    rss0 = 0
    gc0 = 0
    t0 = time.perf_counter()
    for i in range(calls):
        out, lse = ringmpi.ring_attention(*loc, comm, causal=True, return_lse=True)
        live += track.live_requests()
        b = out.tobytes() + lse.tobytes()
        if first is None:
            first = b
        elif b != first:
            identical = False
        del out, lse, b
        if i + 1 == warm:
            gc.collect()
            rss0, gc0 = _rss(), _gc_requests()
    secs = time.perf_counter() - t0
    gc.collect()
    rss1, gc1 = _rss(), _gc_requests()
    rss2 = _trimmed_rss()
    alive_rings = sum(r() is not None for r in track.rings)
    mine = np.array(
        [live, alive_rings, track.unfreed, track.pending_at_free, gc1 - gc0, not identical],
        dtype=np.int64,
    )
    tot = np.empty_like(mine)
    comm.Allreduce(mine, tot, op=MPI.SUM)
    growth = comm.allreduce((rss1 - rss0) / rss0, op=MPI.MAX)
    trimmed = comm.allreduce((rss2 - rss0) / rss0, op=MPI.MAX)
    flags = comm.allgather(identical)
    res = {
        "calls": calls,
        "rings_made": len(track.rings),
        "live_requests": int(tot[0]),
        "alive_rings": int(tot[1]),
        "unfreed_comms": int(tot[2]),
        "pending_at_free": int(tot[3]),
        "gc_request_growth": int(tot[4]),
        "identical": all(flags),
        "rss0_mb": rss0 / 2**20,
        "rss1_mb": rss1 / 2**20,
        "rss_growth": growth,
        "rss_trimmed_growth": trimmed,
        "s": secs,
    }
    res["ok"] = (
        res["identical"] and not any(tot[:5]) and growth < 0.01 and res["rings_made"] == calls
    )
    return res


def oversub(comm: MPI.Comm, n: int) -> dict:
    """Every layout, causal and not, float32 and float64, against the reference at this P."""
    q, k, v = _qkv(n, seed=5)
    worst, ok = 0.0, True
    for dt in (np.float32, np.float64):
        qd, kd, vd = (x.astype(dt) for x in (q, k, v))
        for causal in (False, True):
            ref, _ = reference.attention(qd, kd, vd, causal=causal)
            if dt == np.float64:
                tol = 1e-12 * max(1.0, float(np.abs(ref).max()))
            else:
                tol = 2 * float(np.abs(dense(qd, kd, vd, causal)[0] - ref).max()) + 1e-6
            for layout in ringmpi.LAYOUTS:
                loc = [ringmpi.shard(x, comm, layout) for x in (qd, kd, vd)]
                out = ringmpi.ring_attention(*loc, comm, causal=causal, layout=layout)
                full = ringmpi.gather(out, n, comm, layout)
                ratio = float(np.abs(full - ref).max()) / tol
                worst = max(worst, ratio)
                ok = ok and ratio <= 1 and bool(np.isfinite(full).all())
    return {"ok": comm.allreduce(ok, op=MPI.LAND), "worst_ratio": worst, "cases": 12, "n": n}


def _tile_fault(comm: MPI.Comm, rank: int, step: int) -> None:
    """Make rank ``rank``'s tile raise on its ``step``-th call (0-based), mid-exchange."""
    import dataclasses

    from ringmpi import arguments

    select = arguments.select

    def faulty(x, *args, **kw):
        be = select(x, *args, **kw)
        calls = [0]

        def tile(*a, **kw):
            calls[0] += 1
            if comm.rank == rank and calls[0] == step + 1:
                raise RuntimeError(f"tile fault on rank {rank} at ring step {step}")
            return be.forward_tile(*a, **kw)

        return dataclasses.replace(be, forward_tile=tile)

    arguments.select = faulty
    # 2048 tokens x 64 x float64 per rank: 2 MiB K/V blocks, sent by rendezvous
    q, k, v = _qkv(2048 * comm.size, h=1, hkv=1, d=64)
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    ringmpi.ring_attention(*loc, comm)


def main(argv: list) -> None:
    comm = MPI.COMM_WORLD
    mode = argv[0]
    t0 = time.perf_counter()
    if mode == "call":
        q, k, v = _qkv(40 * comm.size)
        loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
        ringmpi.ring_attention(*loc, comm, causal=True)
        res = {"ok": True}
    elif mode == "tile-fault":
        _tile_fault(comm, int(argv[1]), int(argv[2]))
        res = {"ok": True}
    elif mode == "numerics":
        res = numerics(comm)
    elif mode == "finite":
        res = finite(comm)
    elif mode == "soak":
        res = soak(comm, int(argv[1]))
    elif mode == "oversub":
        res = oversub(comm, int(argv[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    res["ranks"] = comm.size
    res["wall_s"] = time.perf_counter() - t0
    _say(comm, res)


if __name__ == "__main__":
    main(sys.argv[1:])
