"""Reproducible backward (issue 40): the same dq, dk, dv bits at every P and layout.

Each case runs the reproducible forward and ``ring_attention_backward(...,
reproducible=True)`` on the communicator of the test, gathers the gradients to
global order, hashes them (SHA-256) and compares the hashes of every rank with those
of the same calls on COMM_SELF (P = 1, zigzag, computed on rank 0 in the same test).
Accuracy: against the dense float64 reference gradients with the rule of
tests/test_backward_mpi.py (float64: 1e-11 relative; float32: 3 x the dense float32
peer's error), and against the default mode's backward on the same inputs and
communicator: the reproducible error must not exceed it by more than a small factor.
"""

import itertools
import math

import numpy as np
import pytest
from mpi4py import MPI
from tools.fingerprint import digest
from tools.modcases import MODS, head_parallel_case, without_score_modifiers
from tools.slicecases import ring_cases

import ringmpi
from ringmpi import reproducible
from ringmpi.backward import ring_attention_backward
from ringmpi.reference import attention, attention_backward
from ringmpi.spec import AttentionSpec
from ringmpi.testing import assert_all, dense_backward, once, raises_everywhere, random_qkv

pytestmark = pytest.mark.mpi

N = 301  # a multiple of neither 64 nor any P
CU = (0, 40, 41, 170, N)
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "causal window": dict(causal=True, window=(50, -1)),
    "packed window": dict(cu_seqlens=np.array(CU), window=(20, 7)),
}


def _inputs(dtype, seed=0, n=N, h=4, hkv=2, d=24, batch=None):
    """Global q, k, v (shaped like real data: nonzero means, a few huge keys) and dout."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, n, h, hkv, d, batch, dtype=dtype, realistic=True)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout


def _grads(comm, q, k, v, dout, layout, kw, reproducible=True):
    """(dq, dk, dv) gathered to global order, after the forward of the same mode; with
    sinks, dsinks (H,) after them as the call returned it (one value for every rank)."""
    cut = dict(cu_seqlens=kw.get("cu_seqlens"))
    cut_k = dict(cu_seqlens=kw.get("cu_seqlens_k", kw.get("cu_seqlens")))
    if layout == "balanced":  # computed from the whole mask (self-attention here)
        mods = ("softcap", "alibi_slopes", "sinks")  # not the mask's
        cut = cut_k = dict(dict(causal=False), **{x: y for x, y in kw.items() if x not in mods})
    ql, dl = (ringmpi.shard(x, comm, layout, **cut) for x in (q, dout))
    kl, vl = (ringmpi.shard(x, comm, layout, **cut_k) for x in (k, v))
    mode = dict(layout=layout, reproducible=reproducible, **kw)
    out, lse = ringmpi.ring_attention(ql, kl, vl, comm, return_lse=True, **mode)
    local = ring_attention_backward(dl, ql, kl, vl, out, lse, comm, **mode)
    same = all(g.shape == x.shape and g.dtype == x.dtype for g, x in zip(local, (ql, kl, vl)))
    assert_all(comm, same, f"{layout}: gradient shapes/dtypes differ from the inputs")
    assert_all(comm, len(local) == 3 + ("sinks" in kw), f"{layout}: {len(local)} results")
    if "sinks" in kw:
        ds = local[3]
        same = ds.shape == (q.shape[-2],) and ds.dtype == q.dtype
        assert_all(comm, same, f"{layout}: dsinks is {ds.dtype} {ds.shape}")
    return tuple(
        ringmpi.gather(g, n, comm, layout, **c)
        for g, n, c in zip(local, (q.shape[-3], k.shape[-3], k.shape[-3]), (cut, cut_k, cut_k))
    ) + tuple(local[3:])


def _single(comm, *inputs, kw):
    """The P = 1 hash of the calls, computed on rank 0 alone (COMM_SELF), sent to every rank."""
    h = digest(*_grads(MPI.COMM_SELF, *inputs, "zigzag", kw)) if comm.rank == 0 else None
    return comm.bcast(h, root=0)


def _same_everywhere(comm, mine: str, want: str, tag: str) -> None:
    got = comm.allgather(mine)
    bad = [r for r, x in enumerate(got) if x != want]
    assert_all(comm, not bad, f"{tag}: P={comm.size} hash differs from P=1 on ranks {bad}")


def _check_accuracy(comm, got, default, q, k, v, dout, kw, tag):
    """dq, dk, dv (and dsinks when the call has sinks) against the dense float64 reference.

    float64: the tests/test_backward_mpi.py rule (1e-11 relative) and at most 4x the
    default mode's error. float32 (ringmpi.reproducible_float32, forward and backward):
    float32 scores, lse and chains, as the default mode's, so the two modes' errors are
    two draws of the same noise, whose scale the dense float32 peer shows too, and the
    default's draw moves with P (one case: dv 9.9e-6 at P = 1, 4.6e-6 at P = 5). Measured
    over the slices cases at P = 1 and 5, error / the peer's: this mode dq 0.44 to 1.24,
    dk 0.37 to 1.17, dv 0.64 to 2.31; the default dq 0.31 to 2.09, dk 0.28 to 1.74, dv 0.62
    to 5.01 (and this mode's dv 4.6 in the sinks packed causal window case). So a float32
    gradient is held to 3x the larger of the two scales, + 1e-6 (the rule's floor).

    dsinks sums one term per row, each set by the forward's rounding of that row's lse
    and out; the two modes' forwards round differently, so their dsinks errors against the
    reference are two draws of that noise (either may be 6x the other): dsinks is held to
    the peer's rule and to the exact value of its own inputs (:func:`_check_dsinks`).
    """
    ref = once(comm, attention_backward, dout, q, k, v, **kw)
    f32 = q.dtype == np.float32
    peer = once(comm, dense_backward, dout, q, k, v, **kw) if f32 else ref
    for name, a, d, want, other in zip(("q", "k", "v", "sinks"), got, default, ref, peer):
        err, err_d = np.abs(a - want).max(), np.abs(d - want).max()
        err_peer = np.abs(other - want).max()
        if f32:
            scale = err_peer if name == "sinks" else max(err_d, err_peer)
            tol, what = 3 * scale + 1e-6, f"3 x max(default {err_d:.3g}, peer {err_peer:.3g})"
        else:
            big = max(1.0, np.abs(want).max())
            tol = 1e-11 * big if name == "sinks" else min(1e-11 * big, 4 * err_d + 1e-15 * big)
            what = f"the rule (1e-11 relative; 4 x the default's {err_d:.3g})"
        assert_all(comm, err <= tol, f"{tag} d{name}: max err {err:.3g} > {what}")
        if name == "sinks":
            _check_dsinks(comm, q, k, v, dout, kw, tag)


def _check_dsinks(comm, q, k, v, dout, kw, tag):
    """dsinks within one rounding of the exact -sum_i exp(sink_h - lse_i) delta_i of the
    out and lse it was given (the reproducible forward's, zigzag, on ``comm``).

    The exact value: float64 terms (np.exp: within an ulp or two of det_exp's) summed by
    math.fsum; allowed: half a unit in the last place of the result's dtype at dsinks_h,
    plus 1e-14 sum_i |term_i| for the float64 terms' own errors.
    """
    cut = dict(cu_seqlens=kw.get("cu_seqlens"))
    cut_k = dict(cu_seqlens=kw.get("cu_seqlens_k", kw.get("cu_seqlens")))
    ql, dl = (ringmpi.shard(x, comm, **cut) for x in (q, dout))
    kl, vl = (ringmpi.shard(x, comm, **cut_k) for x in (k, v))
    mode = dict(reproducible=True, **kw)
    out, lse = ringmpi.ring_attention(ql, kl, vl, comm, return_lse=True, **mode)
    ds = ring_attention_backward(dl, ql, kl, vl, out, lse, comm, **mode)[3]
    n = q.shape[-3]
    out = ringmpi.gather(out, n, comm, **cut).astype(np.float64)
    lse = ringmpi.gather(lse, n, comm, axis=-1, **cut).astype(np.float64)
    delta = np.moveaxis((dout.astype(np.float64) * out).sum(axis=-1), -1, -2)  # (.., H, S)
    sinks = np.asarray(kw["sinks"], dtype=np.float64)
    terms = np.exp(sinks[:, None] - lse) * delta
    terms = np.moveaxis(terms, -2, 0).reshape(len(sinks), -1)
    exact = -np.array([math.fsum(t) for t in terms])
    tol = 0.5 * np.spacing(np.abs(exact).astype(ds.dtype)) + 1e-14 * np.abs(terms).sum(axis=1)
    err = np.abs(ds.astype(np.float64) - exact)
    w = np.argmax(err / tol)
    msg = f"{tag} dsinks[{w}]: err {err[w]:.3g} from its inputs' exact value > {tol[w]:.3g}"
    assert_all(comm, (err <= tol).all(), msg)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", list(MASKS))
def test_bits_do_not_depend_on_p_or_layout(comm, dtype, mask):
    """GQA (4 query heads on 2 K/V heads), N = 301, every layout: one set of hashes."""
    _every_layout(comm, _inputs(dtype), MASKS[mask], f"{mask} {np.dtype(dtype)}")


def _every_layout(comm, inputs, kw, tag):
    """The P = 1 hashes on every layout (the balanced one too); accuracy at zigzag."""
    want = _single(comm, *inputs, kw=kw)
    for layout in ringmpi.LAYOUTS + ringmpi.layout.MASK_LAYOUTS:
        got = _grads(comm, *inputs, layout, kw)
        _same_everywhere(comm, digest(*got), want, f"{tag} {layout}")
        if layout == "zigzag":
            default = _grads(comm, *inputs, layout, kw, reproducible=False)
            _check_accuracy(comm, got, default, *inputs, kw, f"{tag} {layout}")


CROSS_MODS = {  # for 8 query heads
    "plain": {},
    "all three": dict(
        softcap=4.0, alibi_slopes=0.5 ** np.arange(1, 9), sinks=np.linspace(-3.0, 9.0, 8)
    ),
}


@pytest.mark.parametrize("mod", list(CROSS_MODS))
def test_batched_cross_attention_and_empty_rows(comm, mod):
    """A batch axis, Nq != Nk (517 keys), 8 query heads on 2 K/V heads, rows that see no
    key (no gradient; with sinks, lse = sink and no share of dsinks), without and with
    softcap, ALiBi (query positions aligned to the end of their sequence's keys) and
    sinks: the same bits at every P, within the reference's rule."""
    q = _inputs(np.float32, seed=5, n=131, h=8, hkv=2, d=16, batch=2)[0]
    _, k, v, _ = _inputs(np.float32, seed=6, n=517, h=8, hkv=2, d=16, batch=2)
    dout = np.random.default_rng(7).standard_normal(q.shape).astype(np.float32)
    kw = dict(cu_seqlens=np.array([0, 60, 131]), cu_seqlens_k=np.array([0, 0, 517]), causal=True)
    kw.update(CROSS_MODS[mod])
    want = _single(comm, q, k, v, dout, kw=kw)
    for layout in ("striped", "contiguous"):
        got = _grads(comm, q, k, v, dout, layout, kw)
        _same_everywhere(comm, digest(*got), want, f"cross {mod} {layout}")
    assert_all(comm, not got[0][:, :60].any(), "rows that see no key got a gradient")
    default = _grads(comm, q, k, v, dout, "zigzag", kw, reproducible=False)
    _check_accuracy(comm, got, default, q, k, v, dout, kw, f"cross {mod}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accuracy_on_long_rows(comm, dtype):
    """N = 1024, D = 64, causal: at least as accurate as the default mode (same P, layout)."""
    inputs = _inputs(dtype, seed=23, n=1024, h=4, hkv=2, d=64)
    kw = dict(causal=True)
    got = _grads(comm, *inputs, "zigzag", kw)
    default = _grads(comm, *inputs, "zigzag", kw, reproducible=False)
    _check_accuracy(comm, got, default, *inputs, kw, f"N=1024 {np.dtype(dtype)}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_slices_keep_the_bits(comm, dtype):
    """Masks of slices (each builder, a random union, a cross shape with rows that see no
    key): the P = 1 hashes of dq, dk, dv at every P and layout (the cost-balanced one for
    self-attention), within the reference's rule under the explicit mask."""
    for i, (name, nq, nk, s, mask) in enumerate(ring_cases(197)):
        q, _, _, dout = _inputs(dtype, seed=30 + i, n=nq, d=16)
        _, k, v, _ = _inputs(dtype, seed=50 + i, n=nk, d=16)
        kw = dict(slices=s)
        want = _single(comm, q, k, v, dout, kw=kw)
        layouts = ringmpi.LAYOUTS + (ringmpi.layout.MASK_LAYOUTS if nq == nk else ())
        for layout in layouts:
            tag = f"{name} {np.dtype(dtype)} {layout}"
            got = _grads(comm, q, k, v, dout, layout, kw)
            _same_everywhere(comm, digest(*got), want, tag)
        default = _grads(comm, q, k, v, dout, "zigzag", kw, reproducible=False)
        _check_accuracy(comm, got, default, q, k, v, dout, dict(mask=mask), name)


def test_head_parallel_keeps_the_bits(comm):
    """Heads x ring (head_parallel = U, every U > 1 dividing P), the K/V heads split over
    the group (Hkv a multiple of U) or shared by its members (U a multiple of Hkv): the
    P = 1 bits of dq, dk, dv and dsinks on two layouts, with a mask and all three score
    modifiers (per-head slopes and sinks follow the group's heads), and with the sinks alone
    (the float32 method's forward and its float32 scores in the backward)."""
    us, h, kw_all = head_parallel_case(comm.size)
    for u, kw in itertools.product(us, (kw_all, without_score_modifiers(kw_all))):
        for hkv in [x for x in (1, 2, 3, 4, 6) if x % u == 0 or u % x == 0]:
            q, k, v, dout = _inputs(np.float32, seed=u * 10 + hkv, n=301, h=h, hkv=hkv, d=16)
            q[:, h // 2 :] *= 8.0  # members' bounds differ: the grids must be joined
            dout[:, : h // 3] *= 8.0
            want = _single(comm, q, k, v, dout, kw=kw)
            for layout in ("zigzag", "striped"):
                cut = dict(layout=layout, head_parallel=u)
                ql, kl, vl, dl = (ringmpi.shard(x, comm, **cut) for x in (q, k, v, dout))
                out, lse = ringmpi.ring_attention(
                    ql, kl, vl, comm, return_lse=True, reproducible=True, **cut, **kw
                )
                grads = ring_attention_backward(
                    dl, ql, kl, vl, out, lse, comm, reproducible=True, **cut, **kw
                )
                full = [ringmpi.gather(g, 301, comm, **cut) for g in grads[:3]] + [grads[3]]
                tag = f"U={u} Hkv={hkv} {layout} {sorted(kw)}"
                _same_everywhere(comm, digest(*full), want, tag)


MOD_MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "packed causal window": dict(cu_seqlens=np.array(CU), causal=True, window=(20, -1)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mod", list(MODS))
def test_modifiers_keep_the_bits(comm, dtype, mod):
    """Softcap, ALiBi and sinks, alone and together (tools/modcases.py), GQA, without and
    with causality and packing (ALiBi's positions restart per sequence): the P = 1 hash of
    dq, dk, dv (and dsinks) at every P and layout; within the reference's rule and the
    default mode's error (zigzag)."""
    inputs = _inputs(dtype, seed=21, d=16)
    for mask, kw in MOD_MASKS.items():
        _every_layout(comm, inputs, dict(kw, **MODS[mod]), f"{mod} {mask} {np.dtype(dtype)}")


def test_refusals_name_the_reason(comm):
    """The GPU stays refused in the backward, with the reason; the score modifiers are not."""
    for name, value in (("softcap", 20.0), ("sinks", [0.5] * 4), ("alibi_slopes", [0.1] * 4)):
        spec = AttentionSpec(reproducible=True, **{name: value})
        why = reproducible.refusals(spec, np, backward=True)
        assert_all(comm, why == [], f"{name} refused: {why}")
    gpu = reproducible.refusals(AttentionSpec(reproducible=True), xp=object(), backward=True)
    assert_all(comm, any("GPU" in w for w in gpu), f"no GPU refusal: {gpu}")
    assert_all(comm, reproducible.refusals(AttentionSpec(reproducible=True), np, backward=True)
               == [], "the plain backward refused")  # fmt: skip


def test_default_mode_unchanged(comm):
    """reproducible=False is the default backward: the same bits as without the keyword."""
    q, k, v, dout = _inputs(np.float32, seed=9)
    cut = [ringmpi.shard(x, comm) for x in (q, k, v, dout)]
    out, lse = ringmpi.ring_attention(*cut[:3], comm, causal=True, return_lse=True)
    a = ring_attention_backward(cut[3], *cut[:3], out, lse, comm, causal=True)
    b = ring_attention_backward(cut[3], *cut[:3], out, lse, comm, causal=True, reproducible=False)
    same = all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))
    assert_all(comm, same, "reproducible=False changed the default bits")


def test_value_width_and_spec(comm):
    """Dk != Dv (issue 42) and the options given as ``spec=``: P-independent bits, accurate."""
    q, k, _, _ = _inputs(np.float32, seed=12)
    rng = np.random.default_rng(13)
    v = (1.0 + 0.1 * rng.standard_normal((N, 2, 40))).astype(np.float32)
    dout = rng.standard_normal((N, 4, 40)).astype(np.float32)
    kw = dict(causal=True, window=(70, -1))
    want = _single(comm, q, k, v, dout, kw=kw)
    got = _grads(comm, q, k, v, dout, "striped", kw)
    _same_everywhere(comm, digest(*got), want, "dv=40")
    cut = [ringmpi.shard(x, comm, "striped") for x in (q, k, v, dout)]
    spec = AttentionSpec(layout="striped", reproducible=True, **kw)
    out, lse = ringmpi.ring_attention(*cut[:3], comm, return_lse=True, spec=spec)
    local = ring_attention_backward(cut[3], *cut[:3], out, lse, comm, spec=spec)
    by_spec = [ringmpi.gather(g, N, comm, "striped") for g in local]
    _same_everywhere(comm, digest(*by_spec), want, "spec=")
    default = _grads(comm, q, k, v, dout, "zigzag", kw, reproducible=False)
    _check_accuracy(comm, got, default, q, k, v, dout, kw, "dv=40")


def test_an_lse_that_is_not_the_forwards_raises_everywhere(comm):
    """The grids assume exp(s - lse) <= 2: an lse far below the forward's is refused on
    every rank after the ring (one rank's rows alone may not show it)."""
    q, k, v, dout = _inputs(np.float64, seed=14, n=150)
    cut = [ringmpi.shard(x, comm) for x in (q, k, v, dout)]
    out, lse = ringmpi.ring_attention(*cut[:3], comm, reproducible=True, return_lse=True)
    low = lse - (5.0 if comm.rank == comm.size - 1 else 0.0)
    raises_everywhere(
        comm,
        lambda: ring_attention_backward(cut[3], *cut[:3], out, low, comm, reproducible=True),
        "lse is not the forward's",
    )


@pytest.mark.parametrize("n", [2, 65])
def test_ranks_without_rows(comm, n):
    """N = 2 (most ranks hold no token) and 65 (one full block and one of a single row):
    the same bits. out and lse come from the dense reference, rounded to float32 (the
    backward's bits depend on its inputs only, whichever forward made them)."""
    q, k, v, dout = _inputs(np.float32, seed=15, n=n)
    kw = dict(causal=True)
    out, lse = (x.astype(np.float32) for x in once(comm, attention, q, k, v, **kw))

    def grads(c, layout):
        cut = [ringmpi.shard(x, c, layout) for x in (q, k, v, dout, out)]
        lse_l = ringmpi.shard(lse, c, layout, axis=-1)
        local = ring_attention_backward(
            cut[3], *cut[:3], cut[4], lse_l, c, layout=layout, reproducible=True, **kw
        )
        return digest(*(ringmpi.gather(g, n, c, layout) for g in local))

    want = comm.bcast(grads(MPI.COMM_SELF, "zigzag") if comm.rank == 0 else None, root=0)
    for layout in ringmpi.LAYOUTS:
        _same_everywhere(comm, grads(comm, layout), want, f"n={n} {layout}")
