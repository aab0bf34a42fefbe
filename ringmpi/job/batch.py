"""Batches: consecutive short sequences of a ring packed into one ring call.

A dataset of many moderate sequences spent its time around the kernels: a
read, a ring call, a part file, a marker and an fsync per sequence per rank,
and several collectives each. The loop therefore takes the sequences a ring
was dealt in runs (:func:`make_batches`) of up to ``cap`` tokens
(:func:`batch_tokens`: ``RINGMPI_BATCH_TOKENS``, lowered to what the memory
budget allows) and computes each run as ONE packed sequence: the members one
after another along the token axis, their boundaries as ``cu_seqlens``
(a member that is itself packed keeps its own boundaries inside), so no token
sees another member's (the masks skip those tiles). Each rank's tokens of the
batch are exactly its tokens of every member, in member order
(:func:`ringmpi.partition.positions` applies the layout within each packed
sequence), so the reads concatenate and the outputs split back (:func:`split`).

Results: a batch of one sequence is the very call the job made before
(bitwise). A member of a larger batch is computed by the same tiles against
the same keys, but the key blocks a tile folds at a time start at the batch's
block boundaries, not the member's: the float32 sums group differently, so
the member equals its own call to rounding (well inside verify's tolerance),
not bit for bit. ``RINGMPI_BATCH_TOKENS=0`` turns batching off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import env
from .budget import rank_bytes
from .schema import InputError

__all__ = ["Batch", "batch_tokens", "make_batches", "split", "joined", "check_batch",
           "check_output", "DEFAULT_TOKENS"]  # fmt: skip

DEFAULT_TOKENS = int(env.REGISTRY["RINGMPI_BATCH_TOKENS"].default)
BALANCE = 4  # batches per ring at least, when the rings share many short sequences


@dataclass(frozen=True)
class Batch:
    """Sequences ``members`` (plan indices, consecutive in the ring's order) as one packed call.

    ``length``/``length_k``: query / key tokens of all members; ``cu_seqlens`` and
    ``cu_seqlens_k``: the packed offsets (None, as the sequence itself has, for a
    batch of one).
    """

    members: tuple
    length: int
    length_k: int
    cu_seqlens: Optional[tuple]
    cu_seqlens_k: Optional[tuple]
    name: str

    @property
    def single(self) -> bool:
        return len(self.members) == 1


def batch_tokens(plan, ring_size: int, layout: str, budget: int) -> int:
    """Tokens one batch may hold: ``RINGMPI_BATCH_TOKENS`` (default 65,536), within ``budget``.

    The memory check is the one a single sequence of that many tokens gets
    (:func:`ringmpi.job.budget.rank_bytes` on the rank holding the most);
    0 disables batching (every batch one sequence).
    """
    try:
        cap = env.get("RINGMPI_BATCH_TOKENS")
    except ValueError as e:
        raise InputError(str(e)) from None
    if cap <= 0:
        return 0

    def fits(n: int) -> bool:
        n_local = -(-n // ring_size) + 2  # zigzag/striped: at most a chunk or two more per rank
        return rank_bytes(plan, n_local, prefetch=True, n_local_k=n_local, ranks=ring_size) <= (
            budget
        )

    while cap > 256 and not fits(cap):
        cap //= 2
    return cap if fits(cap) else 0


def make_batches(plan, todo, cap: int, rings: int = 1) -> list:
    """Split ``todo`` (plan indices, in order) into consecutive :class:`Batch` runs of <= ``cap``.

    A sequence of ``cap`` tokens or more (queries or keys) is a batch of its own;
    so is every sequence when ``cap`` is 0. With ``rings`` rings sharing the
    work, a batch holds at most 1/(BALANCE x rings) of all the tokens, so that
    every ring gets batches and the last batches even out the rings' times.
    """
    todo = list(todo)
    total = sum(max(plan.sequences[i].length, plan.sequences[i].length_k) for i in todo)
    if cap > 0 and rings > 1:
        cap = max(1, min(cap, -(-total // (BALANCE * rings))))
    out, run, tokens = [], [], 0
    for i in todo:
        s = plan.sequences[i]
        n = max(s.length, s.length_k)
        if run and (tokens + n > cap or n >= cap):
            out.append(_batch(plan, run))
            run, tokens = [], 0
        run.append(i)
        tokens += n
        if n >= cap:
            out.append(_batch(plan, run))
            run, tokens = [], 0
    if run:
        out.append(_batch(plan, run))
    return out


def _batch(plan, members: list) -> Batch:
    seqs = [plan.sequences[i] for i in members]
    if len(seqs) == 1:
        s = seqs[0]
        return Batch((members[0],), s.length, s.length_k, s.cu_seqlens, s.cu_seqlens_k, s.name)
    cu, cu_k, cross = [0], [0], False
    for s in seqs:
        own = s.cu_seqlens if s.cu_seqlens is not None else (0, s.length)
        own_k = s.cu_seqlens_k if s.cu_seqlens_k is not None else own
        if s.cu_seqlens is None and s.length_k != s.length:
            own_k = (0, s.length_k)
        cross = cross or tuple(own_k) != tuple(own)
        base, base_k = cu[-1], cu_k[-1]
        cu.extend(base + int(x) for x in own[1:])
        cu_k.extend(base_k + int(x) for x in own_k[1:])
    name = f"{seqs[0].name}..{seqs[-1].name} ({len(seqs)} sequences)"
    return Batch(tuple(members), cu[-1], cu_k[-1], tuple(cu), tuple(cu_k) if cross else None, name)


def split(out: np.ndarray, lse: np.ndarray, rows: list) -> list:
    """The members' (out (n_s, H, D), lse (H, n_s)) from the batch's, ``rows`` = [n_s, ...]."""
    if len(rows) == 1:
        return [(out, lse)]
    edges = np.cumsum([0] + list(rows))
    return [(out[a:b], lse[:, a:b]) for a, b in zip(edges[:-1], edges[1:])]


def joined(arrays: list, axis: int) -> np.ndarray:
    """``np.concatenate(arrays, axis)``, without a copy when the arrays are the consecutive
    slices of one array along ``axis`` (a batch's output split into its members)."""
    full = [a for a in arrays if a.size]  # an empty slice may point anywhere
    if not full:
        return np.concatenate(arrays, axis=axis)
    a0 = full[0]
    step, at, total = a0.strides[axis], a0.ctypes.data, 0
    for a in full:
        same = a.strides == a0.strides and a.dtype == a0.dtype and a.ndim == a0.ndim
        if (
            not same
            or a.ctypes.data != at
            or any(n != m for d, (n, m) in enumerate(zip(a.shape, a0.shape)) if d != axis)
        ):
            return np.concatenate(arrays, axis=axis)
        at += a.shape[axis] * step
        total += a.shape[axis]
    shape = a0.shape[:axis] + (total,) + a0.shape[axis + 1 :]
    return np.lib.stride_tricks.as_strided(a0, shape=shape, strides=a0.strides, writeable=False)


def check_batch(path: str, seqs: list, items: list, out, lse) -> None:
    """:func:`check_output` of every member of a batch, in one pass over the batch's arrays.

    The output's minimum and maximum are finite exactly when no element is inf or NaN
    (both propagate NaN), and the lse's maximum is below +inf exactly when no element is
    NaN or +inf; only otherwise are the members checked one by one (which names the first
    bad one). (Two vectorised reductions: 4.5 ms per 65k-token batch, against 12 ms for
    the float64 sum it replaces.)
    """
    out, lse = np.asarray(out), np.asarray(lse)
    fine = out.size == 0 or bool(np.isfinite(out.min()) and np.isfinite(out.max()))
    if fine and lse.size and not lse.max() < np.inf:
        fine = False
    if not fine:
        for s, it in zip(seqs, items):
            check_output(path, s, *it[1:])


def check_output(path: str, seq, pos: np.ndarray, out: np.ndarray, lse: np.ndarray) -> None:
    """Refuse to write a non-finite result (the inputs were checked finite when read).

    Finite inputs can still overflow the accumulation dtype: float32 logits beyond
    ~3e38 turn into inf and then NaN. Such a sequence must fail with a clear error,
    not be written and marked complete. A row with no visible key has lse = -inf
    by design, so only NaN and +inf count there.
    """
    bad = ~np.isfinite(out)
    bad_lse = np.isnan(lse) | np.isposinf(lse)
    if bad.any() or bad_lse.any():
        rows = np.flatnonzero(bad.reshape(len(out), -1).any(axis=1))
        t = int(pos[rows[0]]) if len(rows) else int(pos[np.argwhere(bad_lse)[0][-1]])
        raise InputError(
            f"{path}: sequence {seq.name}: attention output is not finite (token {t}): the "
            f"scores overflow {out.dtype} arithmetic; rescale the input or use float64"
        )
