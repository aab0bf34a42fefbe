"""Packed-sequence offsets stay out of the plan's broadcast: every rank reads them itself.

Rank 0 scans the inputs and broadcasts the :class:`ringmpi.job.schema.Plan` as a
pickle. A ``cu_seqlens`` may hold up to ``MAX_PACKED`` + 1 offsets per group, and an
input may have many groups: pickled into that one broadcast they would cost rank 0
a copy of all of them at once, and every rank the whole pickle before anything is
checked. Instead :func:`strip` replaces each offsets array by its length and
SHA-256; each other rank then reads the arrays from the first input itself, with
the same bounded slab reads and checks as rank 0 (:func:`ringmpi.job.inputs.read_offsets`),
and :func:`fill` refuses, on every rank alike, an array that differs from what rank 0
checked (the file changed while the job was planning).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import numpy as np

from . import inputs
from .inputs import check_offsets, fail

__all__ = ["strip", "fill", "digest", "of_group"]

NAMES = ("cu_seqlens", "cu_seqlens_k")


def digest(cu: np.ndarray) -> tuple:
    """(entries, SHA-256 hex) of an int64 offsets array, shape (n+1,)."""
    a = np.ascontiguousarray(cu, dtype=np.int64)
    return len(a), hashlib.sha256(a.tobytes()).hexdigest()


def strip(plan):
    """(plan without offsets arrays, {(sequence index, name): (entries, sha256)}).

    Parameters
    ----------
    plan : Plan
        As :func:`ringmpi.job.schema.scan` built it; left unchanged.
    """
    sums: dict = {}
    seqs = []
    for i, s in enumerate(plan.sequences):
        gone = {}
        for name in NAMES:
            cu = getattr(s, name)
            if cu is not None:
                sums[(i, name)] = digest(cu)
                gone[name] = None
        seqs.append(replace(s, **gone) if gone else s)
    return replace(plan, sequences=seqs), sums


def fill(plan, sums: dict):
    """The plan with its offsets arrays read from the first input and checked against ``sums``.

    Raises InputError naming the file when an array cannot be read, fails the
    checks, or differs from the one rank 0 checked.

    Parameters
    ----------
    plan : Plan
        A plan from :func:`strip` (offsets missing).
    sums : dict
        ``{(sequence index, name): (entries, sha256)}`` from :func:`strip`.
    """
    from .. import interrupt

    if not sums:
        return plan
    path = plan.files[0]
    f = inputs.open_input(path)
    try:
        fsize = os.path.getsize(path)
        seqs = list(plan.sequences)
        for (i, name), (n, sha) in sorted(sums.items()):
            interrupt.check()
            s = seqs[i]
            node = f[s.group] if s.group else f
            if name not in node:
                gone = "is gone (the file changed while the job was planning)"
                inputs.fail(path, f"'{name}' of sequence {s.name} {gone}")
            cu = inputs.read_offsets(path, node, name, fsize, n - 1)
            if digest(cu) != (n, sha):
                inputs.fail(
                    path,
                    f"'{name}' of sequence {s.name} differs from what rank 0 checked "
                    "(the file changed while the job was planning)",
                )
            seqs[i] = replace(s, **{name: cu})
        return replace(plan, sequences=seqs)
    finally:
        f.close()


def of_group(files, metas, index: int, g: str, per_file: list) -> tuple:
    """(cu_seqlens, cu_seqlens_k) of group ``g`` for the scan (:func:`ringmpi.job.schema.scan`):
    from the first shard, identical in the others."""
    where = f"group '{g}': " if g else ""
    got = []
    for name in ("cu_seqlens", "cu_seqlens_k"):
        first = metas[0]["seqs"][index][1].get(name)
        for p, meta in zip(files[1:], metas[1:]):
            other = meta["seqs"][index][1].get(name)
            if other is None:
                continue
            if first is None:
                fail(p, f"{where}'{name}' must be in the first shard {files[0]} (or in all)")
            if other.shape != first.shape or (other != first).any():
                fail(p, f"{where}'{name}' differs from the one in {files[0]}")
        got.append(first)
    cu, cu_k = got
    if cu is None and cu_k is not None:
        fail(files[0], f"{where}'cu_seqlens_k' needs 'cu_seqlens' (the query offsets)")
    if cu is None:
        return None, None
    n_q, n_k = sum(a for a, _ in per_file), sum(b for _, b in per_file)
    check_offsets(files[0], where, "cu_seqlens", cu, n_q)
    if cu_k is None and n_k != n_q:
        fail(files[0], f"{where}q has {n_q} tokens, k/v {n_k}: packed cross-attention needs "
                       "'cu_seqlens_k' (key/value offsets) beside 'cu_seqlens'")  # fmt: skip
    if cu_k is not None:
        check_offsets(files[0], where, "cu_seqlens_k", cu_k, n_k)
        if len(cu_k) != len(cu):
            fail(files[0], f"{where}'cu_seqlens' has {len(cu) - 1} sequences but "
                           f"'cu_seqlens_k' has {len(cu_k) - 1}")  # fmt: skip
    return cu, cu_k
