"""Reproducible mode (issue 40): the same bits at every P, layout, CPU kernel, ISA path.

Each case hashes (SHA-256) the gathered out and lse of ``ring_attention(...,
reproducible=True)`` on the communicator of the test, gathers the hashes with
``allgather`` and compares them with the hashes of the same call on COMM_SELF
(P = 1, zigzag, computed on rank 0 in the same test). Accuracy: the dense float64
reference with the rule of :func:`ringmpi.testing.assert_close` (the float32 peer
for float32), on values shaped like real data.
"""

import contextlib
import itertools

import numpy as np
import pytest
from mpi4py import MPI
from tools.fingerprint import digest
from tools.modcases import MODS, head_parallel_case, without_score_modifiers
from tools.slicecases import ring_cases

import ringmpi
from ringmpi import reproducible
from ringmpi.reference import attention
from ringmpi.spec import AttentionSpec
from ringmpi.testing import assert_all, assert_close, dense, once, random_qkv

pytestmark = pytest.mark.mpi

N = 283  # a multiple of nothing useful
CU = (0, 40, 41, 170, N)
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window=(37, 5)),
    "causal window": dict(causal=True, window=(50, -1)),
    "packed": dict(cu_seqlens=np.array(CU)),
    "packed causal window": dict(cu_seqlens=np.array(CU), causal=True, window=(20, -1)),
}


def _inputs(dtype, seed=0, n=N):
    return random_qkv(np.random.default_rng(seed), n, 4, 2, 24, dtype=dtype, realistic=True)


def _run(comm, q, k, v, layout, kw):
    """(gathered out, gathered lse) of the reproducible call on ``comm``."""
    cut = dict(cu_seqlens=kw.get("cu_seqlens"))
    if layout == "balanced":
        cut = dict(kw)
    ql, kl, vl = (ringmpi.shard(x, comm, layout, **cut) for x in (q, k, v))
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, layout=layout, return_lse=True, reproducible=True, **kw
    )
    return (
        ringmpi.gather(out, q.shape[-3], comm, layout, **cut),
        ringmpi.gather(lse, q.shape[-3], comm, layout, axis=-1, **cut),
    )


def _single(comm, q, k, v, kw):
    """The P = 1 hash of the call, computed on rank 0 alone (COMM_SELF), sent to every rank."""
    h = digest(*_run(MPI.COMM_SELF, q, k, v, "zigzag", kw)) if comm.rank == 0 else None
    return comm.bcast(h, root=0)


def _same_everywhere(comm, mine: str, want: str, tag: str) -> None:
    got = comm.allgather(mine)
    bad = [r for r, x in enumerate(got) if x != want]
    assert_all(comm, not bad, f"{tag}: P={comm.size} hash differs from P=1 on ranks {bad}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", list(MASKS))
def test_bits_do_not_depend_on_p_or_layout(comm, dtype, mask):
    kw = MASKS[mask]
    q, k, v = _inputs(dtype)
    want = _single(comm, q, k, v, kw)
    ref = once(comm, attention, q, k, v, **kw)
    f32 = dtype == np.float32
    peer = once(comm, dense, q, k, v, **kw) if f32 else (None, None)
    for layout in ringmpi.LAYOUTS:
        tag = f"{mask} {np.dtype(dtype)} {layout}"
        out, lse = _run(comm, q, k, v, layout, kw)
        _same_everywhere(comm, digest(out, lse), want, tag)
        assert_all(comm, out.dtype == dtype, f"{tag}: out is {out.dtype}")
        assert_close(comm, out, ref[0], peer[0], f"{tag} out")
        assert_close(comm, lse, ref[1], peer[1], f"{tag} lse")


MOD_MASKS = ("none", "causal", "packed causal window")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mod", list(MODS))
def test_modifiers_keep_the_bits_at_every_p_and_layout(comm, dtype, mod):
    """Softcap, ALiBi and sinks (issue 40): the P = 1 hash at every P and layout, with masks
    without and with causality and packing (ALiBi's positions restart per sequence), GQA;
    within the default mode's tolerance of the dense float64 reference."""
    q, k, v = _inputs(dtype, seed=21)
    f32 = dtype == np.float32
    for mask in MOD_MASKS:
        kw = dict(MASKS[mask], **MODS[mod])
        want = _single(comm, q, k, v, kw)
        ref = once(comm, attention, q, k, v, **kw)
        peer = once(comm, dense, q, k, v, **kw) if f32 else (None, None)
        for layout in ringmpi.LAYOUTS:
            tag = f"{mod} {mask} {np.dtype(dtype)} {layout}"
            out, lse = _run(comm, q, k, v, layout, kw)
            _same_everywhere(comm, digest(out, lse), want, tag)
            assert_close(comm, out, ref[0], peer[0], f"{tag} out")
            assert_close(comm, lse, ref[1], peer[1], f"{tag} lse")


@pytest.mark.parametrize(
    "setting",
    [
        {"RINGMPI_CPU_KERNEL": "numpy"},
        {"RINGMPI_CPU_KERNEL": "auto", "RINGMPI_CPU_ISA": "scalar"},
        {"RINGMPI_CPU_KERNEL": "auto", "RINGMPI_CPU_ISA": "avx2"},
        {"RINGMPI_CPU_KERNEL": "auto", "threads": 2},
    ],
    ids=["numpy", "fused-scalar", "fused-avx2", "threads-2"],
)
@pytest.mark.parametrize("mod", ["plain", "all three"])
def test_bits_do_not_depend_on_kernel_isa_or_threads(comm, setting, mod, monkeypatch):
    """The CPU kernel choice, its ISA path and the thread pools' sizes select nothing here.

    ``threads``: the BLAS and OpenMP pools set to 2 threads (threadpoolctl) for the call.
    ``mod``: no score modifier, or softcap, ALiBi and sinks together.
    """
    kw = dict(causal=True, window=(60, -1), **MODS.get(mod, {}))
    q, k, v = _inputs(np.float32, seed=3)
    want = _single(comm, q, k, v, kw)
    threads = setting.get("threads")
    for name, value in setting.items():
        if name != "threads":
            monkeypatch.setenv(name, value)
    pools = contextlib.nullcontext()
    if threads is not None:  # an install_requires, but a site stack may lack it
        pools = pytest.importorskip("threadpoolctl").threadpool_limits(limits=threads)
    with pools:  # every BLAS and OpenMP pool
        out, lse = _run(comm, q, k, v, "striped", kw)
    _same_everywhere(comm, digest(out, lse), want, f"{setting}")


def test_batched_cross_attention_and_empty_rows(comm):
    """A batch axis, cross-attention (Lq != Lk) and rows that see no key (out 0, lse -inf)."""
    rng = np.random.default_rng(5)
    nq, nk = 131, 203
    q = random_qkv(rng, nq, 4, 2, 16, batch=2, realistic=True)[0]
    _, k, v = random_qkv(rng, nk, 4, 2, 16, batch=2, realistic=True)
    kw = dict(cu_seqlens=np.array([0, 60, nq]), cu_seqlens_k=np.array([0, 0, nk]))
    hashes = []
    for c in (comm, MPI.COMM_SELF):
        if c is MPI.COMM_SELF and comm.rank != 0:
            continue
        ql = ringmpi.shard(q, c, "zigzag", cu_seqlens=kw["cu_seqlens"])
        kl, vl = (ringmpi.shard(x, c, "zigzag", cu_seqlens=kw["cu_seqlens_k"]) for x in (k, v))
        out, lse = ringmpi.ring_attention(ql, kl, vl, c, return_lse=True, reproducible=True, **kw)
        out = ringmpi.gather(out, nq, c, "zigzag", cu_seqlens=kw["cu_seqlens"])
        lse = ringmpi.gather(lse, nq, c, "zigzag", axis=-1, cu_seqlens=kw["cu_seqlens"])
        hashes.append(digest(out, lse))
        if c is comm:
            full, full_lse = out, lse
    want = comm.bcast(hashes[1] if comm.rank == 0 else None, root=0)
    _same_everywhere(comm, hashes[0], want, "batched cross")
    empty = full[:, :60]
    assert_all(comm, not empty.any() and np.isneginf(full_lse[..., :60]).all(), "empty rows")
    ref = once(comm, attention, q, k, v, **kw)
    assert_close(comm, full, ref[0], once(comm, dense, q, k, v, **kw)[0], "batched cross out")


def test_refusals_name_the_reason(comm):
    """The GPU refuses the mode with the reason; the default mode refuses nothing. (Masks of
    slices, once refused, run: test_slices_keep_the_bits_at_every_p_and_layout.)"""
    gpu = reproducible.refusals(AttentionSpec(reproducible=True), xp=object())
    assert_all(comm, any("GPU" in w for w in gpu), f"no GPU refusal: {gpu}")
    assert_all(comm, reproducible.refusals(AttentionSpec(), xp=object()) == [], "default refused")
    sliced = AttentionSpec(reproducible=True, slices=ringmpi.slices.prefix_lm(40, 8))
    assert_all(comm, reproducible.refusals(sliced, np, backward=True) == [], "slices refused")


def test_default_mode_unchanged(comm):
    """reproducible=False is the default path: the same bits, and no new output attribute."""
    q, k, v = _inputs(np.float32, seed=9)
    cut = [ringmpi.shard(x, comm) for x in (q, k, v)]
    a = ringmpi.ring_attention(*cut, comm, causal=True, return_lse=True)
    b = ringmpi.ring_attention(*cut, comm, causal=True, return_lse=True, reproducible=False)
    same = all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))
    assert_all(comm, same, "reproducible=False changed the default bits")
    assert_all(comm, "reproducible" not in AttentionSpec().to_attrs(), "new default attribute")
    on = AttentionSpec(reproducible=True)
    assert_all(comm, AttentionSpec.from_attrs(on.to_attrs()) == on.validate(), "round trip")


def test_grids_split_exactly():
    """Fold parts are exact: their sums in any order agree, and they add back to x."""
    rng = np.random.default_rng(1)
    n = 1000
    x = rng.standard_normal(n) * np.exp(rng.uniform(-30, 0, n))
    consts = reproducible.grids(n, np.abs(x).max())
    sums = [np.zeros(()) for _ in consts]
    reproducible.fold_into(x, consts, sums, axis=0)
    perm = [np.zeros(()) for _ in consts]
    for i in rng.permutation(n):
        reproducible.fold_into(x[i : i + 1], consts, perm, axis=0)
    assert [float(a) for a in sums] == [float(a) for a in perm]
    total = sums[0] + sums[1] + sums[2]
    assert abs(total - np.sum(np.sort(x))) <= 1e-15 * np.abs(x).sum()


def test_bits_do_not_depend_on_the_rest_of_the_batch(comm):
    """A sequence gives the same bits alone and as one member of a batch."""
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 97, 2, 1, 8, batch=3, realistic=True)
    k[2] *= 50.0  # another member with other magnitudes
    kw = dict(causal=True)
    one = _run(comm, q[1], k[1], v[1], "striped", kw)
    both = _run(comm, q, k, v, "striped", kw)
    same = np.array_equal(one[0], both[0][1]) and np.array_equal(one[1], both[1][1])
    assert_all(comm, same, "batch member 1 differs from the same sequence alone")


@pytest.mark.parametrize("dv", [8, 40])
def test_value_width_keeps_the_bits_and_the_accuracy(comm, dv):
    """Dk != Dv (issue 42) in reproducible mode: P-independent bits, exact against float64."""
    rng = np.random.default_rng(11)
    q, k, _ = _inputs(np.float32, seed=5)
    v = (1.0 + 0.1 * rng.standard_normal((N, 2, dv))).astype(np.float32)
    kw = dict(causal=True, window=(70, -1))
    want = _single(comm, q, k, v, kw)
    out, lse = _run(comm, q, k, v, "zigzag", kw)
    _same_everywhere(comm, digest(out, lse), want, f"dv={dv}")
    ref, ref_lse = once(comm, attention, q, k, v, **kw)
    peer = once(comm, dense, q, k, v, **kw)
    assert_close(comm, out, ref, peer[0], f"dv={dv} out")
    assert_close(comm, lse, ref_lse, peer[1], f"dv={dv} lse")


@pytest.mark.parametrize("n", [1, 2, 65])
def test_ranks_holding_no_key_take_part(comm, n):
    """N below P (and below one key block): ranks that hold no token still deal, pass the
    ring and give the P = 1 bits (deal_keys once failed on a rank with no keys)."""
    q, k, v = _inputs(np.float64, seed=3, n=n)
    kw = dict(causal=True)
    want = _single(comm, q, k, v, kw)
    ref = once(comm, attention, q, k, v, **kw)
    for layout in ("zigzag", "contiguous"):
        out, lse = _run(comm, q, k, v, layout, kw)
        _same_everywhere(comm, digest(out, lse), want, f"N={n} {layout}")
        assert_close(comm, out, ref[0], None, f"N={n} {layout} out")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_keys_already_on_their_blocks_stay_put(comm, dtype, monkeypatch):
    """N = 256 P under a contiguous layout: every rank already holds its whole key blocks in
    position order, so deal_keys moves nothing (no deal_rows, on every rank); zigzag deals.
    Both give the P = 1 bits."""
    q, k, v = _inputs(dtype, seed=4, n=256 * comm.size)
    kw = dict(causal=True)
    want = _single(comm, q, k, v, kw)
    dealt = []

    def spy(*args, **kwargs):
        dealt.append(1)
        return deal_rows(*args, **kwargs)

    deal_rows = reproducible.deal_rows
    monkeypatch.setattr(reproducible, "deal_rows", spy)
    for layout in ("contiguous", "zigzag"):
        dealt.clear()
        out, lse = _run(comm, q, k, v, layout, kw)
        _same_everywhere(comm, digest(out, lse), want, f"N=256 P {layout}")
        moved = layout == "zigzag" and comm.size > 1
        assert_all(comm, bool(dealt) == moved, f"{layout}: deal_rows called {len(dealt)} times")


def test_head_parallel_keeps_the_bits(comm):
    """Heads x ring (head_parallel = U, every U > 1 dividing P): the P = 1 bits of out and lse,
    with GQA (K/V heads split across the group or shared), a mask and all three score
    modifiers (their per-head slopes and sinks follow each group's heads), and with the
    sinks alone (the float32 method). The backward's: tests/test_reproducible_backward_mpi.py."""
    us, h, kw_all = head_parallel_case(comm.size)
    for u, kw in itertools.product(us, (kw_all, without_score_modifiers(kw_all))):
        for hkv in sorted({1, u}):
            rng = np.random.default_rng(u * 10 + hkv)
            q, k, v = random_qkv(rng, 301, h, hkv, 16, dtype=np.float32, realistic=True)
            want = _single(comm, q, k, v, kw)
            for layout in ("zigzag", "striped"):
                cut = dict(layout=layout, head_parallel=u)
                ql, kl, vl = (ringmpi.shard(x, comm, **cut) for x in (q, k, v))
                out, lse = ringmpi.ring_attention(
                    ql, kl, vl, comm, return_lse=True, reproducible=True, **cut, **kw
                )
                out = ringmpi.gather(out, 301, comm, **cut)
                lse = ringmpi.gather(lse, 301, comm, axis=-1, **cut)
                tag = f"U={u} Hkv={hkv} {layout} {sorted(kw)}"
                _same_everywhere(comm, digest(out, lse), want, tag)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_slices_keep_the_bits_at_every_p_and_layout(comm, dtype):
    """Masks of slices (global + local, prefix-LM, shared prompts, block-sparse, random
    unions, a cross shape): the P = 1 hash at every P and layout (the cost-balanced one
    included), within the default mode's tolerance of the dense float64 reference on the
    explicit mask; rows that see no key give out 0 and lse -inf."""
    f32 = dtype == np.float32
    for i, (name, nq, nk, s, mask) in enumerate(ring_cases(197)):
        rng = np.random.default_rng(30 + i)
        q, k, v = random_qkv(rng, nq, 4, 2, 16, nk=nk, dtype=dtype, realistic=True)
        kw = dict(slices=s)
        want = _single(comm, q, k, v, kw)
        ref = once(comm, attention, q, k, v, mask=mask)
        peer = once(comm, dense, q, k, v, mask=mask) if f32 else (None, None)
        layouts = ringmpi.LAYOUTS + (("balanced",) if nq == nk else ())
        for layout in layouts:
            tag = f"{name} {np.dtype(dtype)} {layout}"
            out, lse = _run(comm, q, k, v, layout, kw)
            _same_everywhere(comm, digest(out, lse), want, tag)
            assert_close(comm, out, ref[0], peer[0], f"{tag} out")
            assert_close(comm, lse, ref[1], peer[1], f"{tag} lse")
            empty = ~mask.any(axis=1)
            ok = (out[empty] == 0).all() and (lse[:, empty] == -np.inf).all()
            assert_all(comm, ok, f"{tag}: rows with no visible key give out 0 and lse -inf")
