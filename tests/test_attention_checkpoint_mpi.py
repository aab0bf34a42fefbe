"""The forward ring's checkpoint seam: a ring resumed at any step is bitwise one uninterrupted call.

Runs under mpiexec at any P (the issue asks for P = 2, 3, 4: run it at each).
``on_state`` of :func:`ringmpi.attention.resumable_ring_attention` sees the running
state after every step; ``start=(s, acc, m, l)``
started from a copy of what it saw after step s must give the same bits of out
and lse as the call that never stopped, for every s, layout and mask, on every
CPU tile; and the uninterrupted call itself matches the dense float64 reference.
"""

import numpy as np
import pytest

import ringmpi
from ringmpi.attention import resumable_ring_attention
from ringmpi.reference import attention
from ringmpi.testing import assert_all, random_qkv

pytestmark = pytest.mark.mpi


def _case(comm, n, dtype, realistic=True, seed=3):
    rng = np.random.default_rng(seed)
    qkv = random_qkv(rng, n, 4, 2, 32, realistic=realistic) if comm.rank == 0 else None
    return [x.astype(dtype) for x in comm.bcast(qkv)]


def _run(comm, loc, layout, causal, window=None, **kw):
    return resumable_ring_attention(
        *loc, comm, causal=causal, layout=layout, window=window, return_lse=True, **kw
    )


@pytest.mark.parametrize("kernel", ["auto", "numpy"])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_resume_at_every_step_is_bitwise(comm, layout, causal, dtype, kernel, monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
    n = 61 * comm.size + 7  # ranks hold unequal counts
    q, k, v = _case(comm, n, dtype)
    loc = [ringmpi.shard(x, comm, layout) for x in (q, k, v)]
    seen, saved = [], {}

    def on_state(done, acc, m, l):
        seen.append((done, id(acc), id(m), id(l)))
        saved[done] = (acc.copy(), m.copy(), l.copy())

    out, lse = _run(comm, loc, layout, causal, on_state=on_state)
    # exact: the uninterrupted call is dense float64 attention to rounding
    ref, ref_lse = attention(q, k, v, causal=causal)
    full = ringmpi.gather(out, n, comm, layout)
    full_lse = ringmpi.gather(lse, n, comm, layout, axis=-1)
    tol = 1e-12 if dtype == np.float64 else 5e-5
    err = np.abs(full - ref).max() / max(1.0, np.abs(ref).max())
    lerr = np.abs(full_lse - ref_lse).max() / max(1.0, np.abs(ref_lse).max())
    assert_all(comm, err < tol and lerr < tol, f"uninterrupted call off: {err:.2e} {lerr:.2e}")
    # the callback saw every step, in order, and the running state itself (no copies)
    steps = [s for s, *_ in seen]
    assert_all(comm, steps == list(range(1, comm.size + 1)), f"steps seen {steps}")
    assert_all(comm, len({tuple(x[1:]) for x in seen}) == 1, "state copied between steps")
    want_acc = np.float64 if dtype == np.float64 else np.float32
    assert_all(comm, saved[1][0].dtype == want_acc, f"state dtype {saved[1][0].dtype}")
    for s in range(0, comm.size + 1):
        start = (s, *saved[s]) if s else None
        got, got_lse = _run(comm, loc, layout, causal, start=start)
        same = np.array_equal(got, out) and np.array_equal(got_lse, lse)
        same = same and got.tobytes() == out.tobytes() and got_lse.tobytes() == lse.tobytes()
        assert_all(comm, same, f"resumed at step {s}/{comm.size}: not bitwise the same")
    # the caller's saved state is not modified by a resume
    if comm.size > 1:
        before = saved[1][0].copy()
        _run(comm, loc, layout, causal, start=(1, *saved[1]))
        assert_all(comm, np.array_equal(before, saved[1][0]), "resume wrote into start's arrays")


def test_resume_masked_ring_and_batch(comm):
    """A window shorter than a block (fewer ring steps than P) and a batch axis: still bitwise."""
    n = 50 * comm.size
    q, k, v = _case(comm, n, np.float32, seed=5)
    q, k, v = (np.stack([x, x[::-1] * 0.5]) for x in (q, k, v))  # (2, n, h, d)
    loc = [ringmpi.shard(x, comm, "contiguous") for x in (q, k, v)]
    saved = {}

    def keep(done, acc, m, l):
        saved[done] = (acc.copy(), m.copy(), l.copy())

    stats = {}
    out, lse = _run(comm, loc, "contiguous", True, window=(60, 0), on_state=keep, stats=stats)
    nsteps = stats["steps"]
    assert_all(comm, sorted(saved) == list(range(1, nsteps + 1)), f"saved {sorted(saved)}")
    for s in range(1, nsteps + 1):
        st = {}
        got, got_lse = _run(
            comm, loc, "contiguous", True, window=(60, 0), start=(s, *saved[s]), stats=st
        )
        same = got.tobytes() == out.tobytes() and got_lse.tobytes() == lse.tobytes()
        assert_all(comm, same and st["steps_resumed"] == s, f"masked resume at {s}/{nsteps}")
        assert_all(comm, st["steps_computed"] <= nsteps - s, f"recomputed {st['steps_computed']}")


def test_bad_start_fails_on_every_rank(comm):
    q, k, v = _case(comm, 20 * comm.size, np.float64)
    loc = [ringmpi.shard(x, comm, "zigzag") for x in (q, k, v)]
    saved = {}
    _run(comm, loc, "zigzag", False, on_state=lambda s, a, m, l: saved.setdefault(s, (a, m, l)))
    cases = {
        "step past the ring": (comm.size + 1, *saved[1]),
        "wrong dtype": (1, saved[1][0].astype(np.float32), saved[1][1], saved[1][2]),
        "wrong shape": (1, saved[1][0][:, :, :1], saved[1][1], saved[1][2]),
    }
    if comm.size > 1:  # one rank disagrees on the step
        cases["ranks disagree"] = (1 if comm.rank else 2, *saved[1 if comm.rank else 2])
    for _what, start in cases.items():
        with pytest.raises(ValueError, match="ring_attention: .*(start|different ring steps)"):
            _run(comm, loc, "zigzag", False, start=start)
        comm.Barrier()
    # still usable afterwards
    out = _run(comm, loc, "zigzag", False)[0]
    assert_all(comm, np.isfinite(out).all(), "ring broken after a refused start")
