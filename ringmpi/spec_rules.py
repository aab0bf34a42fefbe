"""The rules of the :class:`ringmpi.spec.AttentionSpec` fields, one function each.

``AttentionSpec.validate`` applies the ``check_*`` rules (ValueError naming the
field); the ``parse_*`` functions read the command-line forms (argparse errors
before anything is created).
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

import numpy as np

__all__ = [
    "check_window", "check_offsets", "check_scale", "check_per_head", "check_softcap",
    "check_positive", "parse_positive",
    "check_head_parallel", "parse_scale", "parse_window", "parse_softcap",
]  # fmt: skip


def check_window(window) -> Optional[tuple]:
    """``window`` as (left, right) ints >= -1, or None (also for (-1, -1)); ValueError otherwise."""
    if window is None:
        return None
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"window must be None or (left, right), got {window!r}") from None
    if left < -1 or right < -1 or (left, right) != tuple(window):
        raise ValueError(f"window sizes must be integers >= -1 (-1: unbounded), got {window!r}")
    return None if (left, right) == (-1, -1) else (left, right)


def check_offsets(name: str, cu) -> Optional[tuple]:
    """Packed-sequence offsets as a tuple of ints (comparable across ranks), or None.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    cu : int array (n_seq + 1,), list, CuPy array or None
        Offsets [0, n1, n1 + n2, ..., N]; their sum N is checked later, against the
        sequence length (:meth:`AttentionSpec.mask`).
    """
    if cu is None:
        return None
    try:
        a = np.asarray(cu.get() if hasattr(cu, "get") else cu)
    except (TypeError, ValueError):
        a = np.zeros(0)
    if a.ndim != 1 or len(a) < 2 or a.dtype.kind not in "iu" or a[0] != 0 or (np.diff(a) < 0).any():
        raise ValueError(f"{name} must be 1-D integer offsets [0, ..., N], never decreasing")
    return tuple(int(x) for x in a)


def check_scale(scale) -> Optional[float]:
    if scale is None:
        return None
    try:
        x = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a number, got {scale!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"scale must be finite, got {x}")
    return x


def check_per_head(name: str, x) -> Optional[tuple]:
    """A per-head float array (slopes, sinks) as a tuple of finite floats, or None."""
    if x is None:
        return None
    try:
        a = np.asarray(x.get() if hasattr(x, "get") else x)
        ok = a.ndim == 1 and len(a) > 0 and a.dtype.kind in "iuf"
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a 1-D array of floats, one per query head")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {a.tolist()}")
    return tuple(float(v) for v in a)


def check_positive(name: str, c) -> Optional[float]:
    """A finite float > 0 (e.g. ``softcap``), or None; ValueError naming the field."""
    if c is None:
        return None
    try:
        x = float(c)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number > 0, got {c!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return x


def check_softcap(c) -> Optional[float]:
    """``softcap``: :func:`check_positive`."""
    return check_positive("softcap", c)


def check_head_parallel(u) -> int:
    if isinstance(u, bool) or not isinstance(u, (int, np.integer)) or u < 1:
        raise ValueError(f"head_parallel={u!r} must be a positive integer (a divisor of the ranks)")
    return int(u)


def parse_scale(text: str) -> float:
    """``--scale``: a finite number (checked before anything is created)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {text!r}")
    return x


def parse_window(text: str) -> tuple:
    """``--window L[,R]``: (L, R), or (L, L) for one number; integers >= -1 (-1: unbounded)."""
    parts = [t.strip() for t in str(text).split(",")]
    try:
        vals = [int(t) for t in parts]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or min(vals) < -1:
        raise argparse.ArgumentTypeError(
            f"expected LEFT or LEFT,RIGHT, integers >= -1 (-1: unbounded), not {text!r}"
        )
    return (vals[0], vals[-1])


def parse_positive(text: str) -> float:
    """``--softcap C`` and the like: a finite number > 0 (checked before anything is created)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, not {text!r}")
    return x


parse_softcap = parse_positive  # the name the CLI first had
