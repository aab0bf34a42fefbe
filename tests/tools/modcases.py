"""Score-modifier cases of the reproducible-mode tests: one set, used by the kernel tests
(tests/cpu/test_fused_reproducible.py) and the ring tests (tests/test_reproducible_mpi.py,
tests/test_reproducible_backward_mpi.py)."""

from __future__ import annotations

import numpy as np

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])  # ALiBi's geometric slopes for 4 heads
MODS = {
    "softcap": dict(softcap=3.0),  # below the largest scores: tanh saturates on the huge keys
    "alibi": dict(alibi_slopes=SLOPES),
    "sinks": dict(sinks=np.array([0.5, 3.0, -2.0, 40.0])),  # the last above every score
    "all three": dict(softcap=5.0, alibi_slopes=SLOPES, sinks=np.array([1.0, -1.0, 6.0, 0.0])),
}


def head_parallel_case(size: int) -> tuple:
    """(the degrees U > 1 dividing ``size``, H, the call's keywords) of the heads x ring
    tests: 12 heads (every U divides them), a causal window and all three modifiers
    with per-head slopes and sinks; skips the test where no U > 1 divides ``size``."""
    import pytest

    us = [u for u in (2, 3, 4) if size % u == 0]
    if not us:
        pytest.skip(f"no head_parallel degree > 1 divides P={size}")
    h = 12
    slopes = 2.0 ** -np.arange(1.0, h + 1.0)
    sinks = np.linspace(-2.0, 6.0, h)
    return us, h, dict(causal=True, window=(90, -1), softcap=5.0, alibi_slopes=slopes, sinks=sinks)


def without_score_modifiers(kw: dict) -> dict:
    """``kw`` without softcap and ALiBi (sinks kept): float32 inputs then run the
    reproducible mode's float32 method (ringmpi.reproducible_float32.eligible)."""
    return {k: v for k, v in kw.items() if k not in ("softcap", "alibi_slopes")}
