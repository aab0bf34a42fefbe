"""The batch job's score modifiers: ALiBi slopes (standard or from a file) and sinks.

``ringmpi run --alibi`` uses the standard geometric slopes of the ALiBi paper
(Press et al., "Train Short, Test Long", 2022) for the H heads of the input;
``--alibi-slopes FILE`` reads H floats from a ``.npy`` file or a text file;
``--softcap C`` is a spec field; a ``sinks`` dataset (H,) in the weights file
gives per-head sink logits. :func:`resolve` puts them into the job's
:class:`ringmpi.spec.AttentionSpec` before anything is created, so the output's
attributes, the resume fingerprint and verify all see them (a resume with other
settings is refused by the fingerprint).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import stat
from typing import Optional

import numpy as np

from ..collective import run_on_root
from ..spec import AttentionSpec, modifier_fields
from . import trust
from .schema import InputError

__all__ = ["alibi_slopes", "read_slopes", "resolve", "check_tiles", "MAX_SLOPES_BYTES"]

#: largest slopes file read (a few thousand heads in text fit many times over)
MAX_SLOPES_BYTES = 1 << 20


def alibi_slopes(h: int) -> tuple:
    """The standard ALiBi slopes of ``h`` heads: a geometric sequence, as float64 numbers.

    For h a power of two, slope_i = 2^(-8 i / h), i = 1..h. Otherwise, with p
    the largest power of two below h, the p slopes of p heads followed by every
    other slope of 2p heads (the odd-numbered ones), h - p of them.

    Parameters
    ----------
    h : int
        Query heads, >= 1.

    Returns
    -------
    tuple of float (h,)
    """
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 1:
        raise ValueError(f"ALiBi needs a positive number of heads, got {h!r}")
    h = int(h)

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    p = 1 << (h.bit_length() - 1)
    if p == h:
        return tuple(power_of_two(h))
    return tuple(power_of_two(p) + power_of_two(2 * p)[0::2][: h - p])


def read_slopes(path: str) -> tuple:
    """ALiBi slopes from a ``.npy`` file (no pickles) or a text file of numbers.

    The file is untrusted content: a regular file only (a FIFO would block), at
    most :data:`MAX_SLOPES_BYTES`, a 1-D array of finite numbers; text is split
    on whitespace and commas, ``#`` starts a comment, each token parsed as a
    float (nothing evaluated). InputError names the file and the problem.
    """
    why = trust.check_regular(path)
    if why:
        raise InputError(f"{path}: {why}")
    try:
        # non-blocking: a FIFO swapped in after the check cannot hang the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(f"{path}: not a regular file: refusing to read it")
            data = f.read(MAX_SLOPES_BYTES + 1)
    except OSError as e:
        raise InputError(f"{path}: cannot read the ALiBi slopes ({e.strerror or e})") from None
    if len(data) > MAX_SLOPES_BYTES:
        raise InputError(f"{path}: larger than {MAX_SLOPES_BYTES} bytes: not a slopes file")
    if data.startswith(b"\x93NUMPY"):
        try:
            a = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(f"{path}: not a readable .npy array ({e})") from None
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iuf":
            raise InputError(f"{path}: the .npy file must hold numbers")
        a = a.astype(np.float64)
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}: neither a .npy file nor UTF-8 text") from None
        words = []
        for line in text.splitlines():
            words += line.split("#", 1)[0].replace(",", " ").split()
        try:
            a = np.array([float(w) for w in words], dtype=np.float64)
        except ValueError as e:
            raise InputError(f"{path}: not a list of numbers ({e})") from None
    if a.ndim != 1 or len(a) == 0:
        raise InputError(f"{path}: the ALiBi slopes must be a 1-D list, got shape {a.shape}")
    if not all(math.isfinite(x) for x in a.tolist()):
        raise InputError(f"{path}: the ALiBi slopes must be finite numbers")
    return tuple(float(x) for x in a)


def resolve(
    comm, spec: AttentionSpec, plan, alibi: bool = False, slopes_file: Optional[str] = None
) -> AttentionSpec:
    """The job's spec with its modifiers filled in from the flags and the inputs (collective).

    Parameters
    ----------
    comm : MPI communicator or None
    spec : AttentionSpec
        The spec from the flags (``softcap`` already in it; ``alibi_slopes`` and
        ``sinks`` when given through the API).
    plan : ringmpi.job.schema.Plan
        The scanned inputs (H, and the weights file's ``sinks``).
    alibi : bool
        ``--alibi``: the standard slopes for H heads.
    slopes_file : str, optional
        ``--alibi-slopes FILE`` (read on rank 0, the same on every rank).

    Raises
    ------
    InputError
        The same on every rank: both ALiBi flags, slopes not H long, sinks given
        twice.
    """
    h = plan.heads
    kw = {}
    if alibi and slopes_file is not None:
        raise InputError("--alibi and --alibi-slopes FILE: give one of them")
    if (alibi or slopes_file is not None) and spec.alibi_slopes is not None:
        raise InputError("ALiBi slopes given twice (in the spec and by --alibi/--alibi-slopes)")
    if alibi:
        kw["alibi_slopes"] = alibi_slopes(h)
    elif slopes_file is not None:
        kw["alibi_slopes"] = run_on_root(comm, read_slopes, slopes_file)
    if plan.sinks is not None:
        if spec.sinks is not None and tuple(spec.sinks) != tuple(plan.sinks):
            raise InputError(f"{plan.weights}: holds sinks, and other sinks were given")
        kw["sinks"] = plan.sinks
    spec = dataclasses.replace(spec, **kw) if kw else spec
    for name in ("alibi_slopes", "sinks"):
        x = getattr(spec, name)
        if x is not None and len(x) != h:
            where = f"{slopes_file}: " if name == "alibi_slopes" and slopes_file else ""
            raise InputError(f"{where}{name} has {len(x)} values but the input has H={h} heads")
    try:
        return spec.validate()
    except ValueError as e:
        raise InputError(str(e)) from None


def check_tiles(spec: AttentionSpec, device: str) -> None:
    """InputError (before any file is made) when the job's tiles cannot apply a modifier.

    The same check the library makes per call (:meth:`ringmpi.backend.Backend.supports`),
    made once up front so that a refused ``--softcap``/``--alibi`` leaves nothing behind.

    Parameters
    ----------
    spec : AttentionSpec
        The resolved spec of the job.
    device : {"cpu", "gpu"}
        The device every rank agreed on (:func:`ringmpi.job.devices.pick_device`).
    """
    from ..backend import select

    wanted = [f for f, meta in modifier_fields() if meta["tile"] and getattr(spec, f) is not None]
    if not wanted:
        return
    try:
        if device == "gpu":
            import cupy

            be = select(cupy.zeros(0))
        else:
            be = select(np.zeros(0))
    except (ImportError, RuntimeError):
        return  # the job reports an unusable backend itself, the usual way
    missing = [f for f in wanted if f not in be.forward_mods or f not in be.backward_mods]
    if missing:
        flags = ", ".join("--" + ("alibi" if f == "alibi_slopes" else f.replace("_", "-"))
                          for f in missing)  # fmt: skip
        hint = "; RINGMPI_CPU_KERNEL=numpy runs them on the CPU" if device == "cpu" else ""
        raise InputError(f"{flags}: the {be.name} tiles do not apply {', '.join(missing)} yet"
                         f"{hint}")  # fmt: skip
