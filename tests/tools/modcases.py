"""Score-modifier cases of the reproducible-mode tests: one set, used by the kernel tests
(tests/cpu/test_fused_reproducible.py) and the ring tests (tests/test_reproducible_mpi.py)."""

from __future__ import annotations

import numpy as np

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])  # ALiBi's geometric slopes for 4 heads
MODS = {
    "softcap": dict(softcap=3.0),  # below the largest scores: tanh saturates on the huge keys
    "alibi": dict(alibi_slopes=SLOPES),
    "sinks": dict(sinks=np.array([0.5, 3.0, -2.0, 40.0])),  # the last above every score
    "all three": dict(softcap=5.0, alibi_slopes=SLOPES, sinks=np.array([1.0, -1.0, 6.0, 0.0])),
}
