"""The plan scan shared by a job's ranks: each scans a share of every file, rank 0 merges.

:func:`scan_files` reads the metadata of every input file, or with ``part=(r, n)`` this
rank's share of it (:func:`ringmpi.job.inputs.scan_file`: the root's entries ``r::n``,
the links below them walked first); :func:`merge` puts the shares back together as the
whole scan would have read them (:func:`ringmpi.job.schema.make_plan`), and checks what
no share can alone: the kinds of data agree, the links walked stay under the limit, every
rank saw the same file.
"""

from __future__ import annotations

from typing import Optional

from .. import interrupt
from . import inputs, trust
from .inputs import fail, guarded

__all__ = ["scan_files", "merge"]


def scan_files(files: list, part: Optional[tuple] = None) -> list:
    """:func:`ringmpi.job.inputs.scan_file` of every file (``part``: this rank's share)."""
    metas, structure = [], None
    for p in files:
        interrupt.check()
        metas.append(guarded(p, inputs.scan_file, p, structure, part))
        structure = metas[0]["structure"]
    return metas


def merge(shares: list, files: list) -> list:
    """The metas of every file from each rank's share (:func:`scan_files` with ``part``).

    The shares' link walks add up to the file's (``MAX_LINKS`` applies to the sum); a
    file every rank saw as the same (device, inode, size, times) gets ``identity``: its
    links are known walked (:func:`ringmpi.job.trust.links_known`).
    """
    out = []
    for path, per_rank in zip(files, zip(*shares)):
        meta = dict(per_rank[0])
        modes = {m["mode"] for m in per_rank} - {None}  # each share's, from its first group
        if len(modes) > 1:
            fail(path, "holds groups of q, k, v and groups of features x: one kind per file")
        if not modes:
            f = inputs.open_input(path)
            try:
                fail(path, inputs.no_data(f))
            finally:
                f.close()
        meta["mode"] = modes.pop()
        seqs = [sq for m in per_rank for sq in m["seqs"]]
        meta["seqs"] = sorted(seqs, key=lambda sq: sq[0])  # the groups' sorted order again
        if sum(m.get("links", 0) for m in per_rank) > trust.MAX_LINKS:
            fail(path, f"holds more than {trust.MAX_LINKS} links")
        seen = {m.get("identity") for m in per_rank}
        meta["identity"] = seen.pop() if len(seen) == 1 else None
        out.append(meta)
    return out
