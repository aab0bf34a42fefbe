"""The tile contract: what every forward and backward tile (numpy, fused C, CUDA) implements.

A *tile call* takes this rank's queries and one visiting K/V block. Arrays are in
the internal head-major layout, all of one array module (numpy or CuPy):

    q      (B, H,   Sq, D)   tile dtype
    k, v   (B, Hkv, Sk, D)   same dtype; query head h reads K/V head h // (H // Hkv)
    q_pos  (Sq,)             int64 global token positions (numpy, host)
    k_pos  (Sk,)             int64 global token positions (numpy, host)

Forward: fold the block into the online-softmax state, in place,

    acc (B, H, Sq, D), m (B, H, Sq), l (B, H, Sq)    accumulation dtype

Backward: add the block's contribution to the gradients, in place,

    dout (B, H, Sq, D)  lse, delta (B, H, Sq)   (delta_i = dout_i . out_i)
    dq   (B, H, Sq, D)  dk, dv (B, Hkv, Sk, D)  (dk, dv summed over each query group)

Both take ``scale`` (score scale), ``causal`` (key j visible to query i iff
k_pos[j] <= q_pos[i]; blocks with no visible pair are skipped, not computed)
and ``progress`` (called between blocks so MPI can progress a pending
exchange; an exception it raises stops the tile and propagates). Both return
the flops of their matrix products over the blocks actually computed: 4 * pairs
* D per head forward, 10 * pairs * D backward. Rows with no visible key keep
l = 0 (forward) and get no gradient (backward, lse = -inf).

Masks beyond causal (windows, packed sequences, cross-attention; built by
:meth:`ringmpi.mask.Mask.bounds`) come as the keyword ``bounds=(lo, hi)``:

    lo, hi (Sq,)   int64 numpy arrays over this rank's query rows, global key
                   positions, inclusive: key j visible to query i iff
                   lo[i] <= k_pos[j] <= hi[i]; lo[i] > hi[i]: no visible key

``bounds`` replaces ``causal`` (it already holds the causal limit; the flag is
then ignored); None (the default) means the ``causal`` flag alone. A tile
skips any block whose key positions lie outside every row's range and need
not mask one that every row sees fully; k_pos need not be sorted or
contiguous (zigzag, striped and packed layouts). What "block" means, and so
the flops returned, is the tile's own (the fused C tile counts per strip of
rows, see :func:`ringmpi.cpu.fused.forward_tile`); every visible pair is
always counted.

Score modifiers (:class:`ringmpi.spec.AttentionSpec` fields registered in
:mod:`ringmpi.scoremods`; built by :func:`ringmpi.mask.tile_modifiers`) come as
keywords, passed only when in use; every tile turns them into one parameter
block with :func:`ringmpi.scoremods.pack` (an unknown keyword: TypeError)::

    softcap  float > 0        s = softcap * tanh(scale * q.k / softcap)
    alibi    (slopes, qa)     slopes float64 numpy (H,) (this call's query heads),
                              qa int64 numpy (Sq,): s += -slopes[h] * abs(qa[i] - k_pos[j])

in this order, then the mask; qa[i] is row i's ALiBi position in key
coordinates (q_pos + Lk_s - Lq_s of its packed sequence s: bottom-right
aligned; q_pos for self-attention). ALiBi never unhides a hidden key, so
skipping is unchanged. Backward: dS is multiplied by 1 - tanh^2 of the capped
score (d/dx of c tanh(x / c)); ALiBi adds no gradient term. Attention sinks
never enter a tile: the forward's finalize folds them into (out, lse)
(:meth:`ringmpi.backend.Backend.finish`), and the backward's lse and delta
already account for them.

The ring loops report ``stats["flops"]`` from :mod:`ringmpi.cost` (the visible
pairs, the same on every backend); the tiles' own counts go to
``stats["tile_flops"]``. What a backend's tiles cannot run (a dtype, a head dim,
a missing backward, an option) it lists in :meth:`ringmpi.backend.Backend.supports`
and the agreement raises on every rank: no tile hands a call to another silently.

:mod:`ringmpi.cpu.numpy_tile` is the specification; the other tiles are tested
against it.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

__all__ = ["ForwardTile", "BackwardTile"]


class ForwardTile(Protocol):
    """Fold one K/V block into (acc, m, l); return the flops spent."""

    def __call__(
        self, q, k, v, q_pos, k_pos, acc, m, l, *,
        scale: float, causal: bool, progress: Optional[Callable[[], None]] = None,
        bounds: Optional[tuple] = None, **modifiers,
    ) -> int: ...  # fmt: skip


class BackwardTile(Protocol):
    """Add one K/V block's gradient contributions to (dq, dk, dv); return the flops spent."""

    def __call__(
        self, q, k, v, dout, lse, delta, q_pos, k_pos, dq, dk, dv, *,
        scale: float, causal: bool, progress: Optional[Callable[[], None]] = None,
        bounds: Optional[tuple] = None, **modifiers,
    ) -> int: ...  # fmt: skip
