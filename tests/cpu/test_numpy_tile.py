"""The numpy tile (the spec) against the dense reference, one process."""

import numpy as np
import pytest

import ringmpi
from ringmpi import slices, softmax
from ringmpi.cpu import numpy_tile as cpu
from ringmpi.layout import positions
from ringmpi.mask import Layer, make_mask, mask_of, plan_steps
from ringmpi.reference import attention, attention_backward
from ringmpi.spec import AttentionSpec
from ringmpi.testing import random_qkv


def internal(x, idx):
    return np.ascontiguousarray(np.moveaxis(x[:, idx], 1, 2))


def simulated_ring(q, k, v, size, layout, causal, dtype):
    """Run every rank's ring steps in one process; returns global (out, lse)."""
    n = q.shape[1]
    out = np.zeros(q.shape, dtype=dtype)
    lse = np.zeros((q.shape[0], q.shape[2], n), dtype=dtype)
    flops = 0
    for r in range(size):
        qp = ringmpi.positions(n, r, size, layout)
        qi = internal(q, qp).astype(dtype)
        acc, m, l = softmax.init_state(qi.shape, dtype)
        for src in range(size):
            kp = ringmpi.positions(n, src, size, layout)
            ki, vi = internal(k, kp).astype(dtype), internal(v, kp).astype(dtype)
            flops += cpu.forward_tile(
                qi, ki, vi, qp, kp, acc, m, l, scale=q.shape[-1] ** -0.5, causal=causal
            )
        o, ls = softmax.finalize(acc, m, l)
        out[:, qp] = np.moveaxis(o, 1, 2)
        lse[..., qp] = ls
    return out, lse, flops


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_matches_reference(rng, layout, causal):
    q = rng.standard_normal((2, 1500, 4, 16))
    k = rng.standard_normal((2, 1500, 2, 16))
    v = rng.standard_normal((2, 1500, 2, 16))
    ref, ref_lse = attention(q, k, v, causal=causal)
    out, lse, _ = simulated_ring(q, k, v, 3, layout, causal, np.float64)
    assert np.abs(out - ref).max() < 1e-12
    assert np.abs(lse - ref_lse).max() < 1e-12


def test_causal_skips_fully_masked_tiles(rng):
    n, size = 4096, 2
    q, k, v = (rng.standard_normal((1, n, 1, 8)) for _ in range(3))
    *_, full = simulated_ring(q, k, v, size, "contiguous", False, np.float64)
    for layout in ringmpi.LAYOUTS:
        *_, masked = simulated_ring(q, k, v, size, layout, True, np.float64)
        # half the pairs are visible; skipping must remove a large share of the work
        assert masked < 0.8 * full, layout


def test_rows_without_visible_key(rng):
    q = rng.standard_normal((1, 2, 5, 8))
    k = rng.standard_normal((1, 1, 7, 8))
    acc, m, l = softmax.init_state(q.shape, np.float64)
    f = cpu.forward_tile(
        q, k, k, np.arange(5), np.arange(10, 17), acc, m, l, scale=1.0, causal=True
    )
    assert f == 0
    out, lse = softmax.finalize(acc, m, l)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_do_not_overflow(rng, dtype):
    q = rng.standard_normal((1, 300, 2, 32)) * 100
    k = rng.standard_normal((1, 300, 2, 32))
    v = rng.standard_normal((1, 300, 2, 32))
    ref, _ = attention(q, k, v, causal=True)
    out, lse, _ = simulated_ring(q, k, v, 2, "zigzag", True, dtype)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(out - ref).max() < (1e-3 if dtype == np.float32 else 1e-10)


# Masks of slices: the tile groups a layer's rows by key range (ringmpi.mask.Layer)


def sliced_ring(s, q, k, v, size, layout, dout=None, dtype=np.float64):
    """Every rank's ring steps of a mask of slices in one process, through StepPlan.tile_at.

    q (B, Sq, H, D), k and v (B, Sk, Hkv, D) global. Returns (out, lse, grads or None,
    forward tile flops, backward tile flops, planner pairs x B x H).
    """
    nq, nk, h = q.shape[1], k.shape[1], q.shape[2]
    mask = mask_of(AttentionSpec(slices=s), nq, nk)
    out = np.zeros(q.shape, dtype=dtype)
    lse = np.zeros((q.shape[0], h, nq), dtype=dtype)
    grads = [np.zeros(x.shape, dtype=dtype) for x in (q, k, v)]
    fwd = bwd = pairs = 0
    scale = q.shape[-1] ** -0.5
    for r in range(size):
        plan = plan_steps(mask, r, size, layout)
        qp = plan.q_pos
        qi = internal(q, qp).astype(dtype)
        acc, m, l = softmax.init_state(qi.shape, dtype)
        blocks = []
        for step in range(plan.nsteps):
            kp = positions(nk, (r - step) % size, size, layout, mask=mask)
            if not plan.compute[step]:
                continue
            ki, vi = internal(k, kp).astype(dtype), internal(v, kp).astype(dtype)
            blocks.append((step, kp, ki, vi))
            tile = plan.tile_at(cpu.forward_tile, step)
            fwd += tile(qi, ki, vi, qp, kp, acc, m, l, scale=scale, causal=False)
            pairs += plan.pairs(step, kp, False) * q.shape[0] * h
        o, ls = softmax.finalize(acc, m, l)
        out[:, qp] = np.moveaxis(o, 1, 2)
        lse[..., qp] = ls
        if dout is None:
            continue
        do = internal(dout, qp).astype(dtype)
        delta = (do * o).sum(axis=-1)
        dq = np.zeros_like(qi)
        for step, kp, ki, vi in blocks:
            dk, dv = np.zeros_like(ki), np.zeros_like(vi)
            tile = plan.tile_at(cpu.backward_tile, step)
            bwd += tile(qi, ki, vi, do, ls, delta, qp, kp, dq, dk, dv, scale=scale, causal=False)
            grads[1][:, kp] += np.moveaxis(dk, 1, 2)
            grads[2][:, kp] += np.moveaxis(dv, 1, 2)
        grads[0][:, qp] = np.moveaxis(dq, 1, 2)
    return out, lse, (grads if dout is not None else None), fwd, bwd, pairs


@pytest.mark.parametrize(
    "s",
    [
        slices.global_local(2048, 128, 32),
        slices.block_sparse(2048, 128, seed=0, causal=True),
    ],
    ids=["global_local", "block_sparse"],
)
@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_sliced_work_follows_the_visible_pairs(rng, s, layout):
    # striped: each rank's keys are every 4th position, so a window or a block of
    # 128 positions is 32 keys of a block; whole position blocks score it many times over
    q = rng.standard_normal((1, 2048, 2, 16))
    k, v = (rng.standard_normal((1, 2048, 1, 16)) for _ in range(2))
    *_, fwd, bwd, pairs = sliced_ring(s, q, k, v, 4, layout, dout=q)
    d = q.shape[-1]
    assert pairs * 4 * d <= fwd <= 1.1 * pairs * 4 * d
    assert pairs * 10 * d <= bwd <= 1.1 * pairs * 10 * d


def _random_union(rng, nq, nk, count):
    out = []
    for _ in range(count):
        q0, q1 = sorted(rng.integers(0, nq + 1, 2))
        k0, k1 = sorted(rng.integers(0, nk + 1, 2))
        kind = slices.KINDS[rng.integers(len(slices.KINDS))]
        if q1 > q0 and k1 > k0 and (kind == "full" or k1 - k0 >= q1 - q0):
            out.append((int(q0), int(q1), int(k0), int(k1), kind))
    return slices.Slices(out)


@pytest.mark.parametrize("layout", [*ringmpi.LAYOUTS, "balanced"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sliced_tile_matches_the_explicit_mask(rng, layout, dtype):
    n = 480
    cases = [
        slices.global_local(n, 40, 9),
        slices.block_sparse(n, 50, seed=3, causal=True),
        slices.shared_prefix(100, [200, 50, 130]),
        # rows 0-99 see no key; rows 100-199 one range, the others two
        slices.Slices([(100, 480, 0, 30, "full"), (200, 400, 100, 300, "bi_causal")]),
        _random_union(rng, n, n, 6),
    ]
    for s in cases:
        q, k, v = random_qkv(rng, n, 4, 2, 16, batch=2, realistic=True)
        dout = rng.standard_normal(q.shape)
        out, lse, grads, *_ = sliced_ring(s, q, k, v, 3, layout, dout=dout, dtype=dtype)
        dense = s.to_dense(n, n)
        ref, ref_lse = attention(q, k, v, mask=dense)
        want = attention_backward(dout, q, k, v, mask=dense)
        tol = 2e-4 if dtype == np.float32 else 1e-10
        assert np.abs(out - ref).max() < tol, s
        finite = np.isfinite(ref_lse)
        assert np.abs(lse[finite] - ref_lse[finite]).max() < tol, s
        empty = ~dense.any(axis=1)
        assert (out[:, empty] == 0).all() and np.isneginf(lse[..., empty]).all()
        for g, w in zip(grads, want):
            assert np.abs(g - w).max() < 50 * tol * max(1.0, np.abs(w).max()), s


def test_sliced_tile_on_65k_keys_and_unsorted_keys(rng):
    # three rows seeing 70,000 keys (several BLOCK_K chunks and float64 sums), one
    # seeing two ranges, one none; the keys in shuffled order give the same result
    nk = 70_000
    s = slices.Slices(
        [(0, 3, 0, nk, "full"), (3, 4, 10, 20, "full"), (3, 4, 60_000, 61_000, "full")]
    )
    q, k, v = random_qkv(rng, 5, 2, 1, 8, batch=1, realistic=True, nk=nk)
    dense = s.to_dense(5, nk)
    ref, ref_lse = attention(q, k, v, mask=dense)
    dout = rng.standard_normal(q.shape)
    want = attention_backward(dout, q, k, v, mask=dense)
    mask = mask_of(AttentionSpec(slices=s), 5, nk)
    qp = np.arange(5)
    layers = mask.layers(qp)
    assert all(isinstance(b, Layer) for b in layers)
    for kp in (np.arange(nk), rng.permutation(nk)):
        qi, ki, vi = internal(q, qp), internal(k, kp), internal(v, kp)
        acc, m, l = softmax.init_state(qi.shape, np.float64)
        flops = 0
        for b in layers:
            flops += cpu.forward_tile(
                qi, ki, vi, qp, kp, acc, m, l, scale=8**-0.5, causal=False, bounds=b
            )
        assert flops == 2 * 2 * (3 * nk + 10 + 1000) * 16
        o, ls = softmax.finalize(acc, m, l)
        assert np.abs(np.moveaxis(o, 1, 2) - ref).max() < 1e-12
        assert np.abs(ls[..., :4] - ref_lse[..., :4]).max() < 1e-12
        assert (o[:, :, 4] == 0).all() and np.isneginf(ls[..., 4]).all()
        do = internal(dout, qp)
        delta = (do * o).sum(axis=-1)
        dq, dk, dv = np.zeros_like(qi), np.zeros_like(ki), np.zeros_like(vi)
        for b in layers:
            cpu.backward_tile(
                qi, ki, vi, do, ls, delta, qp, kp, dq, dk, dv, scale=8**-0.5, causal=False, bounds=b
            )
        for g, w, p in zip((dq, dk, dv), want, (qp, kp, kp)):
            assert np.abs(np.moveaxis(g, 1, 2) - w[:, p]).max() < 1e-12


def test_a_layer_no_row_sees_scores_nothing(rng):
    q, k = rng.standard_normal((1, 2, 6, 8)), rng.standard_normal((1, 1, 9, 8))
    acc, m, l = softmax.init_state(q.shape, np.float64)
    empty = Layer(np.full(6, 5, np.int64), np.full(6, 4, np.int64))
    f = cpu.forward_tile(
        q, k, k, np.arange(6), np.arange(9), acc, m, l, scale=1.0, causal=True, bounds=empty
    )
    assert f == 0 and np.isneginf(m).all() and (l == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_calls_without_slices_keep_the_block_path(rng, dtype, monkeypatch):
    # a window, a causal call and plain bounds: forward_tile is the block function,
    # bit for bit, and never the grouped one
    def refuse(*a, **kw):
        raise AssertionError("a call without slices took the grouped path")

    monkeypatch.setattr(cpu, "_forward_rows", refuse)
    monkeypatch.setattr(cpu, "_backward_rows", refuse)
    n = 1500
    q, k, v = (
        internal(x, np.arange(n)).astype(dtype)
        for x in random_qkv(rng, n, 4, 2, 16, batch=1, realistic=True)
    )
    pos = ringmpi.positions(n, 1, 3, "striped")
    window = make_mask(n, n, True, window=(100, 0)).bounds(pos)
    for bounds, causal in ((window, True), (None, True), (None, False)):
        got, want = (softmax.init_state(q[:, :, pos].shape, dtype) for _ in range(2))
        kw = dict(scale=0.25, causal=causal, bounds=bounds)
        f1 = cpu.forward_tile(q[:, :, pos], k, v, pos, np.arange(n), *got, **kw)
        f2 = cpu._forward_blocks(q[:, :, pos], k, v, pos, np.arange(n), *want, **kw)
        assert f1 == f2
        for a, b in zip(got, want):
            assert a.tobytes() == b.tobytes()
        o, ls = softmax.finalize(*got)
        delta = (o * o).sum(axis=-1)
        bw = [[np.zeros_like(x) for x in (q[:, :, pos], k, v)] for _ in range(2)]
        args = (q[:, :, pos], k, v, o, ls, delta, pos, np.arange(n))
        assert cpu.backward_tile(*args, *bw[0], **kw) == cpu._backward_blocks(*args, *bw[1], **kw)
        for a, b in zip(*bw):
            assert a.tobytes() == b.tobytes()
