"""Opening a run's parts folder on rank 0: a fresh start, or a resume of the same run.

A fresh start refuses to replace an earlier result unasked (``overwrite``) and
removes everything of an earlier run under a final name; a resume checks that the
manifest is this run's and keeps the well-formed completion markers.
:class:`ringmpi.job.store.OutputStore` (and the one-file store) call
:func:`prepare_parts` from ``open``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Callable, Optional

from ..files import exclusive_temp, write_json
from .outdir import lock_output, open_parts_dir
from .schema import InputError, Plan

__all__ = ["OURS", "FORMAT", "fingerprint", "plain_attrs", "prepare_parts", "resume_markers"]

FORMAT = 2  # 2: typed attributes, NaN fill values, dimension labels

# single.h5.tmp: the one-file output being written (ringmpi.job.mpio); .NAME.<hex>.tmp: the
# exclusive temporaries of ringmpi.files.exclusive_temp (.index.h5.<hex>.tmp: the output's
# virtual-dataset file built ahead, ringmpi.job.store)
_NAMES = r"(s\d{6}\.(r\d{5}\.h5|done)|manifest\.json|single\.h5|index\.h5)"
OURS = re.compile(rf"^({_NAMES}(\.tmp)?|\.{_NAMES}\.[0-9a-f]{{12}}\.tmp)$")  # what a run writes
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def prepare_parts(
    path: str, plan: Plan, meta: dict, resume: bool, overwrite: bool,
    marker_ok: Callable[[dict, int], bool],
) -> dict:  # fmt: skip
    """Rank 0: check, lock and start (or, with ``resume``, reopen) ``path``'s parts folder.

    Parameters
    ----------
    path : str
        The final output file (absolute); its parts folder is ``path + ".parts"``.
    plan : Plan
        The job's input plan (no input may be the output or lie in its parts folder).
    meta : dict
        The run's description (:func:`ringmpi.job.store.fingerprint`): written as
        the manifest, or compared with the one there on resume.
    resume : bool
        Continue the run whose manifest is there (a fresh start when there is none).
    overwrite : bool
        Replace an existing output or the parts of an unfinished run.
    marker_ok : callable (marker, i) -> bool
        Does a completion marker describe sequence ``i`` in the store's format?

    Returns
    -------
    dict
        {sequence index: marker} of the well-formed markers a resume found ({} otherwise).
    """
    parts = path + ".parts"
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        raise InputError(f"{path}: output directory {d} does not exist")
    for p in plan.files + ([plan.weights] if plan.weights else []):
        if os.path.exists(path) and os.path.samefile(p, path):
            raise InputError(f"{path}: output would overwrite input {p}")
        folder = os.path.dirname(os.path.abspath(p))
        if os.path.isdir(parts) and os.path.samefile(folder, parts):
            raise InputError(f"{path}: input {p} is inside the output's parts folder")
    try:
        manifest = os.path.join(parts, "manifest.json")
        existed = os.path.lexists(parts)
        if existed and not (resume or overwrite) and not os.path.isdir(parts):
            raise InputError(f"{parts}: exists and is not the job's parts folder")
        dfd = open_parts_dir(parts, create=not existed)
        try:
            lock_output(parts, dfd)
            names = os.listdir(dfd)
            if resume and "manifest.json" in names:
                return resume_markers(dfd, manifest, meta, len(plan.sequences), marker_ok)
            # fresh start: never replace an earlier result unasked
            if not overwrite and os.path.lexists(path):
                raise InputError(
                    f"{path}: output exists; use --overwrite to replace it, or another -o"
                )
            if not overwrite and "manifest.json" in names:
                raise InputError(
                    f"{parts}: holds an unfinished run; use --resume to continue it, "
                    "--overwrite to start again, or another -o"
                )
            # nothing stale may survive under a final name (unlink never follows a symlink)
            if os.path.lexists(path):
                os.remove(path)
            for name in names:
                if OURS.match(name):
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        fd, probe = exclusive_temp(manifest)  # can we write here at all?
        os.close(fd)
        os.unlink(probe)
        write_json(manifest, meta)
        return {}
    except OSError as e:
        raise InputError(f"{path}: cannot write output ({e.strerror or e})") from e


def resume_markers(
    dfd: int, manifest: str, meta: dict, nseq: int, marker_ok: Callable[[dict, int], bool]
) -> dict:
    """The run's manifest must match ``meta``; {index: marker} of the well-formed markers.

    Parameters
    ----------
    dfd : int
        Open descriptor of the parts folder (names are opened relative to it,
        never through a symlink).
    manifest : str
        The manifest's path, for messages.
    meta : dict
        This run's description; any differing key refuses the resume.
    nseq : int
        Sequences of the plan (markers of other indices are ignored).
    marker_ok : callable (marker, i) -> bool
        Does a marker describe sequence ``i``? (An unreadable or wrong one: redo it.)
    """

    def load(name):
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd) as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            return json.loads(fh.read(1 << 24))

    try:
        old = load("manifest.json")
    except (OSError, ValueError) as e:
        raise InputError(f"{manifest}: unreadable ({e}); rerun without --resume") from e
    if not isinstance(old, dict):
        raise InputError(f"{manifest}: not a manifest; rerun without --resume")
    diff = [k for k in sorted(set(old) | set(meta)) if old.get(k) != meta.get(k)]
    if diff:
        raise InputError(
            f"{manifest}: made by a different run (differs in {', '.join(diff)}); "
            "rerun without --resume"
        )
    done = {}
    for name in sorted(os.listdir(dfd)):
        m = re.fullmatch(r"s(\d{6})\.done", name)
        if not m or int(m.group(1)) >= nseq:
            continue
        i = int(m.group(1))
        try:
            marker = load(name)
        except (OSError, ValueError):
            continue  # an unreadable marker means: redo that sequence
        if marker_ok(marker, i):
            done[i] = marker
    return done


def fingerprint(
    plan: Plan, layout: str, causal: bool, scale: Optional[float], nranks: int, ring_size=None
) -> dict:
    """What must match for --resume to reuse finished sequences."""

    def stamp(p):
        st = os.stat(p)  # ctime too: a file rewritten with its mtime reset is a new input
        return [os.path.abspath(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    return {
        "format": FORMAT,
        "inputs": [stamp(p) for p in plan.files],
        "weights": stamp(plan.weights) if plan.weights else None,
        "layout": layout,
        "causal": bool(causal),
        "scale": scale,
        "nranks": nranks,
        "ring_size": nranks if ring_size is None else int(ring_size),
        "dtype": plan.dtype,
        "geometry": [plan.heads, plan.kv_heads, plan.head_dim],
        "sequences": [[s.name, s.length] for s in plan.sequences],
    }


def plain_attrs(meta: dict) -> dict:
    """Attributes from a fingerprint alone: scalars as they are, anything else as JSON."""
    out = {"format": FORMAT}
    for k, v in meta.items():
        if k == "format":
            continue
        ok = isinstance(v, (str, bool, int, float)) and v is not None
        out[k] = v if ok else json.dumps(v)
    return out
