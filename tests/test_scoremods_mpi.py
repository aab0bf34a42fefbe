"""Score modifiers over the ring (ALiBi, softcap, sinks): every layout and mask, any P.

Forward and backward (dsinks included) against the dense float64 reference on
values shaped like real data (nonzero means, small spreads): out within twice a
dense float32 computation's error (plus eps), gradients within three times (plus
the budget of a float32 lse), float64 within 1e-12 relative. A backend whose
tiles cannot apply a modifier must refuse the call on every rank with the reason.
"""

import numpy as np
import pytest

import ringmpi
from ringmpi.backend import select
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import (
    assert_all,
    assert_close,
    dense,
    dense_backward,
    lse_budget,
    once,
    raises_everywhere,
    random_qkv,
)

pytestmark = pytest.mark.mpi

H, HKV, D = 4, 2, 16
MODS = dict(alibi_slopes=(0.25, 0.0625, 0.015625, 0.0), softcap=4.0, sinks=(1.0, -2.0, 0.5, 3.0))

# name -> (nq, nk, causal, mask keywords)
CASES = {
    "causal": (523, 523, True, {}),
    "window": (523, 523, True, dict(window=(60, -1))),
    "two-sided window": (523, 523, False, dict(window=(40, 25))),
    "packed": (523, 523, True, dict(cu_seqlens=(0, 200, 201, 523))),
    "cross causal": (211, 523, True, {}),
    "cross packed": (211, 523, True, dict(cu_seqlens=(0, 100, 211), cu_seqlens_k=(0, 300, 523))),
}


def _inputs(seed, nq, nk, dtype, h=H, hkv=HKV):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, nq, h, hkv, D, dtype=dtype, nk=nk, realistic=True, sinks=0)
    dout = (0.2 + 0.1 * rng.standard_normal(q.shape)).astype(dtype)
    return q, k, v, dout


def _check(comm, q, k, v, dout, causal, layout, mods, **kw):
    """Ring forward + backward vs the reference; kw: mask keywords and head_parallel."""
    nq, nk = q.shape[0], k.shape[0]
    mask = {x: y for x, y in kw.items() if x != "head_parallel"}
    cut = dict(head_parallel=kw.get("head_parallel", 1))
    ql, dl = (
        ringmpi.shard(x, comm, layout, **cut, cu_seqlens=mask.get("cu_seqlens")) for x in (q, dout)
    )
    cu_k = mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
    kl, vl = (ringmpi.shard(x, comm, layout, **cut, cu_seqlens=cu_k) for x in (k, v))
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, causal=causal, layout=layout, return_lse=True, **kw, **mods
    )
    tag = f"P={comm.size} {nq}x{nk} causal={causal} {layout} {q.dtype} {kw} {sorted(mods)}"
    gq = dict(**cut, cu_seqlens=mask.get("cu_seqlens"))
    full = ringmpi.gather(out, nq, comm, layout, **gq)
    full_lse = ringmpi.gather(lse, nq, comm, layout, axis=-1, **gq)
    ref, ref_lse = once(comm, attention, q, k, v, causal, **mask, **mods)
    f32 = q.dtype != np.float64
    peer = once(comm, dense, q, k, v, causal, **mask, **mods) if f32 else (None, None)
    assert_close(comm, full, ref, peer[0], f"{tag} out")
    assert_close(comm, full_lse, ref_lse, peer[1], f"{tag} lse")
    g = ringmpi.ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, causal=causal, layout=layout, **kw, **mods
    )
    want = once(comm, attention_backward, dout, q, k, v, causal, **mask, **mods)
    other = (
        once(comm, dense_backward, dout, q, k, v, causal, **mask, **mods) if f32 else (None,) * 4
    )
    assert_all(comm, len(g) == len(want), f"{tag}: {len(g)} gradients, want {len(want)}")
    cuts = (gq, dict(**cut, cu_seqlens=cu_k), dict(**cut, cu_seqlens=cu_k))
    for gi, w, o, name, n, c in zip(g, want, other, "qkv", (nq, nk, nk), cuts):
        got = ringmpi.gather(gi, n, comm, layout, **c)
        extra = 0.0 if o is None else lse_budget(full_lse, ref_lse, w)
        assert_close(comm, got, w, o, f"{tag} d{name}", factor=3.0, extra=extra)
    if "sinks" in mods:
        extra = 0.0 if other[3] is None else lse_budget(full_lse, ref_lse, want[3])
        assert_close(comm, g[3], want[3], other[3], f"{tag} dsinks", factor=3.0, extra=extra)
        same = comm.allgather(np.asarray(g[3]).tobytes())
        assert_all(comm, len(set(same)) == 1, f"{tag}: dsinks differ across ranks")


@pytest.fixture
def numpy_tiles(monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_all_modifiers(comm, numpy_tiles, case, layout, dtype):
    """ALiBi + softcap + sinks together, every mask and layout, forward and backward."""
    nq, nk, causal, mask = CASES[case]
    q, k, v, dout = _inputs(40, nq, nk, dtype)
    _check(comm, q, k, v, dout, causal, layout, MODS, **mask)


@pytest.mark.parametrize("name", ["alibi_slopes", "softcap", "sinks"])
def test_each_modifier_alone(comm, numpy_tiles, name):
    """Each modifier on its own (causal, zigzag, float32): no hidden reliance on the others."""
    q, k, v, dout = _inputs(41, 523, 523, np.float32)
    _check(comm, q, k, v, dout, True, "zigzag", {name: MODS[name]})


def test_head_parallel(comm, numpy_tiles):
    """Heads x ring: slopes and sinks are split per head group (U = 2 where P is even)."""
    if comm.size % 2:
        pytest.skip(f"head_parallel=2 needs an even P, not {comm.size}")
    q, k, v, dout = _inputs(42, 517, 517, np.float64)
    _check(comm, q, k, v, dout, True, "zigzag", MODS, head_parallel=2, window=(80, 0))
    q, k, v, dout = _inputs(43, 517, 517, np.float32)
    _check(comm, q, k, v, dout, True, "striped", MODS, head_parallel=2)


def test_decode(comm):
    """decode_attention with softcap and sinks (sinks counted once, not per rank)."""
    rng = np.random.default_rng(44)
    q, k, v = random_qkv(rng, 3, H, HKV, D, dtype=np.float64, nk=4099, realistic=True)
    parts = np.array_split(np.arange(4099), comm.size)[comm.rank]
    mods = dict(softcap=MODS["softcap"], sinks=MODS["sinks"])
    out, lse = ringmpi.decode_attention(q, k[parts], v[parts], comm, return_lse=True, **mods)
    ref, ref_lse = once(comm, attention, q, k, v, **mods)
    assert_close(comm, out, ref, None, "decode out")
    assert_close(comm, lse, ref_lse, None, "decode lse")
    raises_everywhere(
        comm,
        lambda: ringmpi.decode_attention(q, k[parts], v[parts], comm, alibi_slopes=[0.1] * H),
        "decode_attention",
        "alibi_slopes",
    )


def test_rows_without_keys(comm, numpy_tiles):
    """A packed sequence with no keys: out 0, lse = the head's sink, on every layout."""
    q, k, v, dout = _inputs(45, 300, 300, np.float64)
    mask = dict(cu_seqlens=(0, 40, 300), cu_seqlens_k=(0, 0, 300))
    for layout in ringmpi.LAYOUTS:
        _check(comm, q, k, v, dout, True, layout, MODS, **mask)
        ql = ringmpi.shard(q, comm, layout, cu_seqlens=mask["cu_seqlens"])
        kl, vl = (ringmpi.shard(x, comm, layout, cu_seqlens=mask["cu_seqlens_k"]) for x in (k, v))
        out, lse = ringmpi.ring_attention(
            ql, kl, vl, comm, causal=True, layout=layout, return_lse=True, **mask, **MODS
        )
        full = ringmpi.gather(out, 300, comm, layout, cu_seqlens=mask["cu_seqlens"])
        fl = ringmpi.gather(lse, 300, comm, layout, axis=-1, cu_seqlens=mask["cu_seqlens"])
        ok = np.array_equal(full[:40], np.zeros_like(full[:40]))
        ok &= np.allclose(fl[:, :40], np.array(MODS["sinks"])[:, None], rtol=0, atol=1e-15)
        assert_all(comm, bool(ok), f"{layout}: empty rows are not (0, sink)")


BAD = [
    (dict(alibi_slopes=[0.1, 0.2]), "alibi_slopes"),
    (dict(sinks=[0.0] * (H + 1)), "sinks"),
    (dict(sinks=[0.0, float("nan"), 0.0, 0.0]), "sinks"),
    (dict(alibi_slopes=[0.1, float("inf"), 0.1, 0.1]), "alibi_slopes"),
    (dict(softcap=0.0), "softcap"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softcap="big"), "softcap"),
    (dict(alibi_slopes=[[0.1, 0.2], [0.3, 0.4]]), "alibi_slopes"),
]


@pytest.mark.parametrize("bad,word", BAD, ids=[w + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_input_raises_everywhere(comm, numpy_tiles, bad, word):
    """A bad modifier: the same one-line ValueError on every rank, forward and backward."""
    q, k, v, dout = _inputs(46, 64, 64, np.float32)
    ql, kl, vl, dl = (ringmpi.shard(x, comm) for x in (q, k, v, dout))
    msg = raises_everywhere(comm, lambda: ringmpi.ring_attention(ql, kl, vl, comm, **bad), word)
    assert_all(comm, "\n" not in msg, f"not one line: {msg!r}")
    out, lse = ringmpi.ring_attention(ql, kl, vl, comm, return_lse=True)
    raises_everywhere(
        comm, lambda: ringmpi.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, **bad), word
    )


def test_ranks_disagree(comm, numpy_tiles):
    """Ranks passing different slopes: refused on every rank (P > 1)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    q, k, v, _ = _inputs(47, 64, 64, np.float32)
    ql, kl, vl = (ringmpi.shard(x, comm) for x in (q, k, v))
    slopes = [0.1 * (1 + comm.rank)] * H
    raises_everywhere(
        comm, lambda: ringmpi.ring_attention(ql, kl, vl, comm, alibi_slopes=slopes), "alibi_slopes"
    )


@pytest.mark.parametrize("kernel", ["auto", "fused"])
def test_cpu_backend_applies_or_refuses(comm, monkeypatch, kernel):
    """The fused CPU backend either matches the reference with the modifiers or refuses them.

    No silent fallback: where its tiles cannot apply softcap/ALiBi yet, the call
    raises on every rank naming the modifier (:meth:`ringmpi.backend.Backend.supports`).
    """
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
    q, k, v, dout = _inputs(48, 331, 331, np.float32)
    try:
        be = select(q)
    except RuntimeError as e:  # RINGMPI_CPU_KERNEL=fused where the fused tile cannot load
        pytest.skip(str(e))
    if "softcap" in be.forward_mods and "alibi_slopes" in be.forward_mods:
        if "softcap" in be.backward_mods and "alibi_slopes" in be.backward_mods:
            _check(comm, q, k, v, dout, True, "zigzag", MODS)
            return
    ql, kl, vl = (ringmpi.shard(x, comm) for x in (q, k, v))
    for name in ("softcap", "alibi_slopes"):
        if name in be.forward_mods:
            continue
        raises_everywhere(
            comm,
            lambda name=name: ringmpi.ring_attention(
                ql, kl, vl, comm, causal=True, **{name: MODS[name]}
            ),
            name,
            "does not apply it",
        )
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, causal=True, return_lse=True, sinks=MODS["sinks"]
    )
    ref_out, ref_lse = once(comm, attention, q, k, v, True, sinks=MODS["sinks"])
    peer = once(comm, dense, q, k, v, True, sinks=MODS["sinks"])
    assert_close(comm, ringmpi.gather(out, 331, comm), ref_out, peer[0], f"{be.name} sinks out")
    assert_close(comm, ringmpi.gather(lse, 331, comm, axis=-1), ref_lse, peer[1], "sinks lse")


def test_grid_rings(comm, numpy_tiles):
    """Rings of a 2-D grid (ring_size 2 where P is even): each ring its own sequence."""
    if comm.size % 2:
        pytest.skip(f"rings of 2 need an even P, not {comm.size}")
    ring, across = ringmpi.grid(comm, ring_size=2)
    try:
        g = across.Get_rank()
        q, k, v, dout = _inputs(50 + g, 301, 301, np.float64)
        _check(ring, q, k, v, dout, True, "zigzag", MODS, window=(70, 0))
    finally:
        ring.Free()
        across.Free()
